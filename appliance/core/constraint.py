"""Structured output: a request's constraint on what it may generate, and its grammar for the grammar library.

The library is llguidance (BENCHMARKS.md "Structured output" says why): no dependencies beyond itself, a token mask
in microseconds, and one grammar format for every kind. Every constraint becomes an llguidance grammar here:
JSON schemas (its JSON compiler), regexes (Rust `regex` syntax), choices (a Lark rule of string literals) and
grammars written in llguidance's Lark dialect (Lark plus `%json {schema}` and `%regex` terminals, and `<|special|>`
tokens). No torch here: the front ends build and check constraints, the engine compiles them per sequence.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from appliance.core.grammar_bounds import BoundError, check_json_nesting, check_lark, check_regex, check_schema

if TYPE_CHECKING:                    # a TypedDict its stub declares (no runtime name)
    from llguidance._lib import JsonCompileOptions

# JSON is generated without optional whitespace (`{"a":1}`): a model (a random-weight one above all) cannot spend
# its tokens on spaces between values. vLLM's default allows any whitespace; `disable_any_whitespace` is implied.
JSON_OPTIONS: "JsonCompileOptions" = {"whitespace_flexible": False}
# Documented request limits (README "Request limits"): a constraint's text and its choices are bounded so that
# checking and compiling one request's grammar stays cheap for everyone else.
MAX_CONSTRAINT_CHARS = 256 * 1024
MAX_CHOICES = 1024


class ConstraintKind(str, Enum):
    JSON_OBJECT = "json_object"    # any JSON object
    JSON_SCHEMA = "json_schema"    # JSON valid under a JSON schema
    REGEX = "regex"                # the whole output matches a regex (Rust regex syntax)
    GRAMMAR = "grammar"            # llguidance's Lark dialect (`start:` rule; %json, %regex, <|special|> tokens)
    CHOICE = "choice"              # exactly one of the given strings


@dataclass(frozen=True)
class OutputConstraint:
    """What a request's output must match. `text` is the schema (JSON text), the regex or the Lark grammar; for a
    choice, `choices`. `field` is the request field the constraint came from: an error about it names that field
    (e.g. "response_format.json_schema.schema", "structured_outputs.regex", "tool_choice")."""

    kind: ConstraintKind
    text: str = ""
    choices: tuple[str, ...] = ()
    field: str = "constraint"

    @classmethod
    def json_object(cls, field: str = "response_format") -> "OutputConstraint":
        return cls(ConstraintKind.JSON_OBJECT, field=field)

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str, field: str = "response_format.json_schema.schema"
                    ) -> "OutputConstraint":
        """A schema as a dict or as JSON text (kept as text: the constraint stays frozen and hashable);
        ConstraintError for a dict too deep to write as JSON."""
        try:
            text = schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False)
        except (ValueError, RecursionError) as exc:
            raise ConstraintError(field, f"cannot be written as JSON ({type(exc).__name__}: nested too deeply or "
                                         f"circular)") from None
        return cls(ConstraintKind.JSON_SCHEMA, text=text, field=field)

    @classmethod
    def regex(cls, pattern: str, field: str = "structured_outputs.regex") -> "OutputConstraint":
        return cls(ConstraintKind.REGEX, text=pattern, field=field)

    @classmethod
    def grammar(cls, lark: str, field: str = "structured_outputs.grammar") -> "OutputConstraint":
        return cls(ConstraintKind.GRAMMAR, text=lark, field=field)

    @classmethod
    def choice(cls, choices: Sequence[str], field: str = "structured_outputs.choice") -> "OutputConstraint":
        return cls(ConstraintKind.CHOICE, choices=tuple(choices), field=field)


class ConstraintError(ValueError):
    """A constraint the grammar library refuses; `field` names the request field (RequestError carries it on)."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)


def choice_lark(choices: Sequence[str]) -> str:
    """A Lark rule matching exactly one of the strings: JSON string literals are Lark string literals."""
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def constraint_grammar(constraint: OutputConstraint) -> str:
    """The llguidance grammar (its JSON envelope) of a constraint (checked by check_constraint first);
    ConstraintError for a schema the library cannot read. Whether the grammar compiles is the engine's compile
    (appliance.engine.grammar), on a thread with a large stack and under a time bound."""
    # Imported here: the CLI's validate and plan modes import this module, and only requests need the library
    # (its import takes about 50 ms).
    from llguidance import LLMatcher

    kind, field = constraint.kind, constraint.field
    try:
        if kind is ConstraintKind.JSON_OBJECT:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind is ConstraintKind.JSON_SCHEMA:
            return LLMatcher.grammar_from_json_schema(constraint.text, defaults=JSON_OPTIONS)
        if kind is ConstraintKind.REGEX:
            return LLMatcher.grammar_from_regex(constraint.text)
        if kind is ConstraintKind.GRAMMAR:
            return LLMatcher.grammar_from_lark(constraint.text)
        return LLMatcher.grammar_from_lark(choice_lark(constraint.choices))
    except ValueError as exc:           # the library's own refusal of a schema it cannot read
        raise ConstraintError(field, f"is refused by the grammar compiler: {library_reason(str(exc))}") from None


def parse_schema(text: str, field: str) -> Any:
    """A schema's JSON text parsed, its nesting bounded first (Python's parser recurses: 100,000 levels would raise
    RecursionError)."""
    try:
        check_json_nesting(text)
        return json.loads(text)
    except BoundError as exc:
        raise ConstraintError(field, str(exc)) from None
    except (ValueError, RecursionError) as exc:
        raise ConstraintError(field, f"is not valid JSON ({library_reason(str(exc))})") from None


def library_reason(message: str, limit: int = 200) -> str:
    """The first line of a library's message, cut at `limit` characters: the grammar library's errors go on with
    the grammar around the fault (a 98 KB error for an 89 KB request), and an error carried in gRPC metadata must
    stay far below its 16 KiB limit."""
    line = next((part.strip() for part in message.splitlines() if part.strip()), "")
    return line if len(line) <= limit else line[:limit] + "..."


def check_constraint(constraint: OutputConstraint) -> None:
    """The checks that need no grammar library, done before anything is queued: valid Unicode, the size limits,
    the choices, and the complexity bounds (appliance/core/grammar_bounds.py: rules, schema depth through $ref,
    repetition product). ConstraintError naming the request field."""
    field = constraint.field
    for text in (constraint.text, *constraint.choices):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ConstraintError(field, f"contains a lone surrogate (U+{ord(text[exc.start]):04X}): send valid "
                                         f"Unicode text") from None
    size = len(constraint.text) + sum(len(c) for c in constraint.choices)
    if size > MAX_CONSTRAINT_CHARS:
        raise ConstraintError(field, f"has {size:,} characters; at most {MAX_CONSTRAINT_CHARS:,}")
    if constraint.kind is ConstraintKind.CHOICE:
        if not constraint.choices:
            raise ConstraintError(field, "must list at least one choice")
        if len(constraint.choices) > MAX_CHOICES:
            raise ConstraintError(field, f"{len(constraint.choices)} choices; at most {MAX_CHOICES}")
        if any(not c for c in constraint.choices):
            raise ConstraintError(field, "a choice must not be empty")
    elif constraint.kind in (ConstraintKind.REGEX, ConstraintKind.GRAMMAR, ConstraintKind.JSON_SCHEMA) \
            and not constraint.text:
        raise ConstraintError(field, "must not be empty")
    try:
        if constraint.kind is ConstraintKind.JSON_SCHEMA:
            schema = parse_schema(constraint.text, field)
            if not isinstance(schema, (dict, bool)):
                raise ConstraintError(field, f"must be a JSON schema object, not {type(schema).__name__}")
            check_schema(schema)
        elif constraint.kind is ConstraintKind.REGEX:
            check_regex(constraint.text)
        elif constraint.kind is ConstraintKind.GRAMMAR:
            check_lark(constraint.text)
    except BoundError as exc:
        raise ConstraintError(field, str(exc)) from None
