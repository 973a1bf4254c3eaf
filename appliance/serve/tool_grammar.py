"""The grammar that enforces `tool_choice` "required" or a named function: the answer must be tool calls in the
model's own format (DeepSeek V4 DSML or Qwen3 `<tool_call>` JSON) to the allowed functions, with arguments valid
under each function's `parameters` schema, so any model (random weights included) complies.

Written in llguidance's Lark dialect (the engine's grammar library, appliance/core/constraint.py): string literals
for the format's markers, `%json {schema}` for JSON values, and terminals built with `&` and `~` (and / not) for
free text that ends at the first end marker. Rules, from the formats (see tool_parsers.py):
- Qwen3: one `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` per call, calls separated by "\\n";
  the call object's schema fixes "name" to the function and "arguments" to its parameters.
- DSV4: `\\n\\n<｜DSML｜tool_calls>\\n` + invokes + `\\n</｜DSML｜tool_calls>`; in an invoke each property of the
  parameters schema is a DSML parameter, in schema order, required ones always and the others optionally, its value
  valid under the property's schema: as JSON (string="false"), or for a string property also as is (string="true",
  as DeepSeek's encoder writes strings) within its enum or length limits. Where the tokenizer holds `｜DSML｜` as
  a special token, a value written as is cannot contain "</" (llguidance's lexer cannot look past it for the
  special token); such a value is written as JSON.
- Reasoning first where the prompt opens it (DSV4 thinking mode: free text up to `</think>`); Qwen3 may open a
  `<think>` block itself unless the prompt closed one (enable_thinking false).
- "named" and parallel_tool_calls false allow exactly one call; "required" one or more (OpenAI's semantics).
JSON is generated without optional whitespace (as the engine's other JSON constraints).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from appliance.serve.reasoning import ReasoningFormat
from appliance.serve.tool_parsers import DSML, QWEN3_END, QWEN3_START, ToolCallFormat

JSON_OPTIONS = {"x-guidance": {"whitespace_flexible": False}}
RAW_STRING_KEYS = frozenset(("type", "description", "title", "examples", "default", "enum", "const", "minLength",
                             "maxLength"))
QWEN3_CALL_START, QWEN3_CALL_END = "<tool_call>\n", "\n</tool_call>"
DSML_INVOKE_CLOSE = f"</{DSML}invoke>"


def lark_string(text: str) -> str:
    """A Lark string literal (JSON string escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def lark_regex_literal(text: str) -> str:
    """`text` escaped for a /regex/ terminal."""
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}/-" else "\\n" if c == "\n" else c for c in text)


def until_first(marker: str) -> str:
    """A terminal: any text that ends with the first occurrence of `marker` (the marker included)."""
    m = lark_regex_literal(marker)
    return f"/(.|\\n)*{m}/ & ~/(.|\\n)*{m}(.|\\n)+/"


def json_rule(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({**JSON_OPTIONS, **schema}, ensure_ascii=False)


@dataclass(frozen=True)
class Markup:
    """Writes the format's markup for llguidance. A marker that the tokenizer holds as one added token (the chat
    formats' markers usually are) is a special token to llguidance: text can never spell it, so it is written as
    `<[id]>` (`specials`: marker -> token id). Plain text is cut so that every newline and every "<" is a literal of
    its own: llguidance's lexer does not backtrack, so no literal may begin with one that another literal could be
    (a bare "\n" against "\n</x>", "<" against "</x>")."""

    specials: Mapping[str, int]

    def split(self, text: str) -> list[str | int]:
        """Plain pieces and special token ids, in order."""
        for marker in sorted(self.specials, key=len, reverse=True):
            at = text.find(marker)
            if at >= 0:
                return [*self.split(text[:at]), self.specials[marker], *self.split(text[at + len(marker):])]
        return [piece for piece in re.split(r"(\n|<)", text) if piece]

    def text(self, text: str) -> str:
        return " ".join(f"<[{p}]>" if isinstance(p, int) else lark_string(p) for p in self.split(text))

    def free_text_until(self, name: str, marker: str, length: str = "*") -> list[str]:
        """Rule `name`: free text (at most / at least as `length` says, a regex repetition) up to the first
        `marker` and the marker. Text before the marker's first special token ends the free text's terminal; the
        rest of the marker follows it."""
        pieces = self.split(marker)
        first_special = next((k for k, p in enumerate(pieces) if isinstance(p, int)), len(pieces))
        stop = "".join(str(p) for p in pieces[:first_special])
        pieces = pieces[first_special:]
        if stop:
            m = lark_regex_literal(stop)
            terminal = f"/(.|\\n){length}{m}/ & ~/(.|\\n)*{m}(.|\\n)+/"
        else:
            terminal = f"/(.|\\n){length}/"
        rest = " ".join(f"<[{p}]>" if isinstance(p, int) else lark_string(p) for p in pieces)
        return [f"{name.upper()}_TEXT: {terminal}", f"{name}: {name.upper()}_TEXT {rest}".rstrip()]


def parameters_issue(parameters: Any) -> tuple[str, str] | None:
    """What in a function's `parameters` the call grammar cannot use, as (the key under `parameters`, why); None
    when nothing. The grammar reads `properties` and `required` itself and writes the schema as JSON."""
    if not isinstance(parameters, dict):
        return None                      # none given: a call takes no arguments (parameters_of)
    if "properties" in parameters and not isinstance(parameters["properties"], dict):
        return ".properties", "must be an object mapping each parameter's name to its schema"
    required = parameters.get("required")
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        return ".required", "must be a list of parameter names"
    try:
        json.dumps(parameters)
    except (ValueError, RecursionError) as exc:
        return "", f"cannot be written as JSON ({type(exc).__name__}: nested too deeply)"
    return None


def parameters_of(tool: dict[str, Any]) -> dict[str, Any]:
    parameters = tool["function"].get("parameters")
    return parameters if isinstance(parameters, dict) and parameters else {"type": "object", "properties": {}}


def raw_string_rules(name: str, schema: Any, markup: Markup) -> list[str] | None:
    """Rule `name`: the DSML value of a string property written as is (string="true", what DeepSeek's encoder
    writes for every string) and the parameter's close tag: free text, a length range or one of an enum / const;
    None for string rules a raw value cannot express here (pattern, format: written as JSON, string="false")."""
    if not isinstance(schema, dict) or schema.get("type") != "string" or not set(schema) <= RAW_STRING_KEYS:
        return None
    close = f"</{DSML}parameter>"
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        if not values or not all(isinstance(v, str) and v and "<" not in v for v in values):
            return None
        return [f"{name}: (" + " | ".join(lark_string(v) for v in values) + f") {markup.text(close)}"]
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if not isinstance(low, int) or not (high is None or isinstance(high, int)):
        return None
    return markup.free_text_until(name, close, f"{{{low},{'' if high is None else high}}}")


def qwen3_call_rules(tools: list[dict[str, Any]], markup: Markup) -> list[str]:
    rules = []
    for i, tool in enumerate(tools):
        call = {"type": "object", "properties": {"name": {"const": tool["function"]["name"]},
                                                 "arguments": parameters_of(tool)},
                "required": ["name", "arguments"], "additionalProperties": False}
        rules.append(f"call_{i}: {markup.text(QWEN3_CALL_START)} call_json_{i} {markup.text(QWEN3_CALL_END)}\n"
                     f"call_json_{i}: {json_rule(call)}")
    return rules


def dsml_call_rules(tools: list[dict[str, Any]], markup: Markup) -> list[str]:
    rules = []
    for i, tool in enumerate(tools):
        parameters = parameters_of(tool)
        properties = parameters.get("properties") or {}
        required = set(parameters.get("required") or ())
        parts = []
        for j, (key, schema) in enumerate(properties.items()):
            as_json = f'\n<{DSML}parameter name="{key}" string="false">'
            rules += [f"value_json_{i}_{j}: json_{i}_{j} {markup.text(f'</{DSML}parameter>')}",
                      f"json_{i}_{j}: {json_rule(schema if isinstance(schema, dict) else {})}"]
            value = f"{markup.text(as_json)} value_json_{i}_{j}"
            raw = raw_string_rules(f"value_raw_{i}_{j}", schema, markup)
            if raw is not None:      # as is (the encoder's way), or as a JSON string when it holds "</"
                rules += raw
                as_is = f'\n<{DSML}parameter name="{key}" string="true">'
                value = f"({markup.text(as_is)} value_raw_{i}_{j}) | ({value})"
            parts.append(f"({value})" + ("" if key in required else "?"))
        head = markup.text(f'<{DSML}invoke name="{tool["function"]["name"]}">')
        # "\n\n" before the close when no parameter was written (the encoder joins none with newlines around)
        rules.append(f"call_{i}: {head} {' '.join(parts)} \"\\n\" \"\\n\"? {markup.text(DSML_INVOKE_CLOSE)}")
    return rules


def tool_call_grammar(fmt: ToolCallFormat, tools: list[dict[str, Any]], *, single: bool,
                      reasoning: ReasoningFormat | None, prompt: str, specials: Mapping[str, int] | None = None
                      ) -> str:
    """The Lark grammar of an answer made only of calls to `tools` (OpenAI tool dicts), in format `fmt`.
    `specials`: the format's markers that the tokenizer holds as single tokens, and their ids."""
    markup = Markup(specials or {})
    calls = " | ".join(f"call_{i}" for i in range(len(tools)))
    if fmt.name == "qwen3":
        rules = qwen3_call_rules(tools, markup)
        body = "call" if single else 'call ("\\n" call)*'
    else:
        rules = dsml_call_rules(tools, markup)
        body = (markup.text(f"\n\n<{DSML}tool_calls>\n") + (" call" if single else ' call ("\\n" call)*')
                + " " + markup.text(f"\n</{DSML}tool_calls>"))
    lead = ""
    if reasoning is not None:
        if reasoning.starts_inside(prompt):
            lead = "reasoning "
        elif reasoning.opens_in_output and not prompt.rstrip().endswith(reasoning.end):
            lead = f'({markup.text(reasoning.start)} reasoning "\\n" "\\n")? '
        if lead:
            rules.extend(markup.free_text_until("reasoning", reasoning.end))
    return "\n".join([f"start: {lead}{body}", f"call: {calls}", *rules]) + "\n"


def marker_tokens(fmt: ToolCallFormat, reasoning: ReasoningFormat | None,
                  token_to_id: Callable[[str], int | None]) -> dict[str, int]:
    """The markers of the format (and its reasoning) that the tokenizer holds as single tokens."""
    markers = [DSML] if fmt.name == "dsml" else [QWEN3_START, QWEN3_END]
    if reasoning is not None:
        markers += [reasoning.start, reasoning.end]
    return {m: token for m in markers if (token := token_to_id(m)) is not None}
