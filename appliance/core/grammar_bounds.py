"""Complexity bounds a structured-output constraint must meet before the grammar library compiles it.

Why: llguidance compiles rules and `$ref`s recursively (a chain of ~2,700 rules overflows an 8 MiB thread stack and
the process dies of SIGSEGV), and a counted repetition is expanded (`a{500}{500}` is 250,000 copies: one token mask
then costs 0.4 s). The engine compiles on a thread with a large stack and under a time bound
(appliance.engine.grammar); these bounds keep every accepted constraint far inside both, and refuse the others
naming the bound. Each check is a linear pass with no recursion, so a deeply nested input cannot overflow Python's
stack here either. No grammar library here.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterator
from urllib.parse import unquote

from appliance.core.bounded_json import json_nesting

MAX_GRAMMAR_RULES = 2_000          # rule and terminal definitions of one Lark grammar
MAX_JSON_NESTING = 128             # arrays and objects inside each other (what llguidance's JSON reader takes)
MAX_SCHEMA_DEPTH = 1_000           # schemas inside each other, following each `$ref` (the compiler's recursion)
MAX_REPETITION_PRODUCT = 10_000    # nested counted repetitions multiplied: `(ab{10}){3}` is 30, `a{500}{500}` 250,000


class BoundError(ValueError):
    """A constraint over a complexity bound; the message names the bound (the caller adds the request field)."""


# -- JSON -----------------------------------------------------------------------------------------------

def check_json_nesting(text: str, limit: int = MAX_JSON_NESTING) -> None:
    deepest, _ = json_nesting(text, next((i for i, c in enumerate(text) if c in "[{"), len(text)))
    if deepest > limit:
        raise BoundError(f"nests JSON arrays and objects {deepest:,} deep; at most {limit:,}")


def _resolve(root: Any, ref: str) -> Any:
    """The node a local `$ref` ("#", "#/$defs/a", JSON pointer escapes) points at; None for any other reference."""
    if not ref.startswith("#") or (len(ref) > 1 and ref[1] != "/"):
        return None
    node = root
    for part in ref[2:].split("/") if len(ref) > 1 else ():
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _children(root: Any, node: Any) -> Iterator[Any]:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            target = _resolve(root, ref)
            if isinstance(target, (dict, list)):
                yield target
        yield from (v for v in node.values() if isinstance(v, (dict, list)))
    elif isinstance(node, list):
        yield from (v for v in node if isinstance(v, (dict, list)))


def schema_depth(root: Any) -> int:
    """How deep schemas nest inside each other when every `$ref` is followed where it stands: the depth the JSON
    compiler recurses to. A reference back into the schemas being compiled (a recursive schema) adds nothing: the
    compiler refers to the rule it is building. Iterative depth-first search, each node measured once."""
    if not isinstance(root, (dict, list)):
        return 0
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, Iterator[Any]]] = [(root, _children(root, root))]
    on_path.add(id(root))
    while stack:
        node, children = stack[-1]
        child = next(children, None)
        if child is None:
            stack.pop()
            on_path.discard(id(node))
            depth[id(node)] = 1 + max((depth.get(id(c), 0) for c in _children(root, node)
                                       if id(c) not in on_path), default=0)
        elif id(child) not in depth and id(child) not in on_path:
            on_path.add(id(child))
            stack.append((child, _children(root, child)))
    return depth[id(root)]


def _patterns(root: Any) -> Iterator[tuple[str, str]]:
    """(JSON path, regex) of every `pattern` and `patternProperties` key in a schema, without recursion."""
    stack: list[tuple[str, Any]] = [("", root)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                yield f"{path}.pattern".lstrip("."), node["pattern"]
            if isinstance(node.get("patternProperties"), dict):
                yield from ((f"{path}.patternProperties".lstrip("."), key) for key in node["patternProperties"])
            stack.extend((f"{path}.{key}", value) for key, value in node.items())
        elif isinstance(node, list):
            stack.extend((f"{path}[{i}]", value) for i, value in enumerate(node))


def check_schema(schema: Any) -> None:
    """A parsed JSON schema within the bounds: its depth through `$ref` and its patterns' repetitions."""
    depth = schema_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise BoundError(f"nests schemas {depth:,} deep following $ref; at most {MAX_SCHEMA_DEPTH:,}")
    for path, pattern in _patterns(schema):
        check_regex(pattern, f"the pattern at {path}")


def check_schema_text(text: str) -> None:
    """A JSON schema's text within the bounds; ValueError when it is not JSON (after the nesting check: parsing
    it is then safe)."""
    check_json_nesting(text)
    check_schema(json.loads(text))


# -- counted repetitions --------------------------------------------------------------------------------

_COUNT = r"\{\s*(?P<low>\d+)\s*(?:,\s*(?P<high>\d*)\s*)?\}"
_REGEX_TOKEN = re.compile(r"""
    (?P<escape>\\(?:[pPxuU]\{[^}]*\}|.))
  | (?P<klass>\[)
  | (?P<flags>\(\?[a-zA-Z-]*\))
  | (?P<open>\((?:\?(?:P?<[^>]*>|[a-zA-Z-]*:))?)
  | (?P<close>\))
  | (?P<count>""" + _COUNT + r""")
  | (?P<quantifier>[*+?|^$])
  | (?P<literal>[^\\\[(){}*+?|^$]+|.)
""", re.X | re.S)


class _Products:
    """Nested counted repetitions multiplied: a stack of groups, each with the largest product inside it and the
    product of its last item (which a following `{m,n}` multiplies)."""

    def __init__(self) -> None:
        self.groups = [[1, 1]]
        self.largest = 1

    def item(self, product: int = 1) -> None:
        group = self.groups[-1]
        group[1] = product
        group[0] = max(group[0], product)
        self.largest = max(self.largest, product)

    def repeat(self, low: str, high: str | None) -> None:
        count = max(int(n) if len(n) < 10 else 10**10 for n in (low, high or low))
        self.item(self.groups[-1][1] * max(count, 1))

    def open(self) -> None:
        self.groups.append([1, 1])

    def close(self) -> None:
        if len(self.groups) > 1:
            self.item(self.groups.pop()[0])


def _class_end(regex: str, i: int) -> int:
    """The index after the character class that opens at regex[i] ("["), nested classes and escapes included."""
    depth, i = 1, i + 1
    if regex.startswith("^", i):
        i += 1
    if regex.startswith("]", i):
        i += 1
    while i < len(regex) and depth:
        c = regex[i]
        if c == "\\":
            i += 1
        elif c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
        i += 1
    return i


def repetition_product(regex: str) -> int:
    """The largest product of nested counted repetitions in a regex (Rust `regex` syntax, as llguidance reads it)."""
    products, pos = _Products(), 0
    while (token := _REGEX_TOKEN.match(regex, pos)) is not None:
        kind, pos = token.lastgroup, token.end()
        if kind == "klass":
            pos = _class_end(regex, token.start())
            products.item()
        elif kind == "open":
            products.open()
        elif kind == "close":
            products.close()
        elif kind == "count":
            products.repeat(token.group("low"), token.group("high"))
        elif kind in ("escape", "literal"):
            products.item()
    return products.largest


def check_regex(regex: str, what: str = "the regex") -> None:
    product = repetition_product(regex)
    if product > MAX_REPETITION_PRODUCT:
        raise BoundError(f"{what} repeats {product:,} times counting nested repetitions ({{m,n}}); at most "
                         f"{MAX_REPETITION_PRODUCT:,}")


# -- Lark grammars ---------------------------------------------------------------------------------------

_DEFINITION = re.compile(r"^[ \t]*[?!]?[A-Za-z_]\w*(?:\.[-+]?\d+)?[ \t]*:", re.M)
_LARK_TOKEN = re.compile(r"""
    (?P<comment>//[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<special><\[[^\]\n]*\]>|<\|[^|\n]*\|>)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<directive>%(?P<name>json|regex|llguidance)\s*(?=\{))
  | (?P<count>""" + _COUNT + r"""|~\s*(?P<times>\d+)(?:\s*\.\.\s*(?P<most>\d+))?)
  | (?P<open>[(\[])
  | (?P<close>[)\]])
  | (?P<word>\w+)
""", re.X)


def check_lark(grammar: str) -> None:
    """A Lark grammar (llguidance's dialect) within the bounds: its definitions, every /regex/ terminal, the counted
    repetitions of its rules, and every embedded `%json {schema}`."""
    products, pos, kept_from, kept = _Products(), 0, 0, []
    while (token := _LARK_TOKEN.search(grammar, pos)) is not None:
        kind, start, pos = token.lastgroup, token.start(), token.end()
        if kind == "open":
            products.open()
        elif kind == "close":
            products.close()
        elif kind == "count":
            products.repeat(token.group("low") or token.group("times"), token.group("high") or token.group("most"))
        elif kind == "word":
            products.item()
        else:                 # a literal, a comment or an embedded JSON: no definition can be inside it
            if kind == "regex":
                text = token.group()
                check_regex(text[1:text.rindex("/")], f"the terminal {_excerpt(text)}")
            elif kind == "directive":
                _, pos = json_nesting(grammar, pos)
                if token.group("name") == "json":
                    _check_embedded_schema(grammar[token.end():pos], start)
            if kind != "comment":
                products.item()
            kept += [grammar[kept_from:start], " "]
            kept_from = pos
    if products.largest > MAX_REPETITION_PRODUCT:
        raise BoundError(f"repeats {products.largest:,} times counting nested repetitions; at most "
                         f"{MAX_REPETITION_PRODUCT:,}")
    rules = len(_DEFINITION.findall("".join(kept) + grammar[kept_from:]))
    if rules > MAX_GRAMMAR_RULES:
        raise BoundError(f"defines {rules:,} rules and terminals; at most {MAX_GRAMMAR_RULES:,}")


def _check_embedded_schema(text: str, at: int) -> None:
    try:
        check_schema_text(text)
    except BoundError as exc:
        raise BoundError(f"%json at character {at}: {exc}") from None
    except ValueError:
        pass                  # not JSON: the grammar compiler refuses it, naming the position


def _excerpt(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
