"""The grammar that enforces `tool_choice` "required" or a named function: the answer must be tool calls in the
model's own format (DeepSeek V4 DSML or Qwen3 `<tool_call>` JSON) to the allowed functions, with arguments valid
under each function's `parameters` schema, so any model (random weights included) complies.

Written in llguidance's Lark dialect (the engine's grammar library, appliance/core/constraint.py): string literals
for the format's markers, `%json {schema}` for JSON values, and terminals built with `&` and `~` (and / not) for
free text that ends at the first end marker. Rules, from the formats (see tool_parsers.py):
- Qwen3: one `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` per call, calls separated by "\\n";
  the call object's schema fixes "name" to the function and "arguments" to its parameters.
- DSV4: `\\n\\n<｜DSML｜tool_calls>\\n` + invokes + `\\n</｜DSML｜tool_calls>`; in an invoke each property of the
  parameters schema is a DSML parameter, in schema order, required ones always and the others optionally: a
  string property is written as is (string="true", as DeepSeek's encoder writes strings) within its enum or
  length limits; any other as JSON (string="false") valid under its own schema.
- Reasoning first where the prompt opens it (DSV4 thinking mode: free text up to `</think>`); Qwen3 may open a
  `<think>` block itself unless the prompt closed one (enable_thinking false).
- "named" and parallel_tool_calls false allow exactly one call; "required" one or more (OpenAI's semantics).
JSON is generated without optional whitespace (as the engine's other JSON constraints).
"""

from __future__ import annotations

import json
from typing import Any

from appliance.serve.reasoning import ReasoningFormat
from appliance.serve.tool_parsers import DSML, ToolCallFormat

JSON_OPTIONS = {"x-guidance": {"whitespace_flexible": False}}
RAW_STRING_KEYS = frozenset(("type", "description", "title", "examples", "default", "enum", "const", "minLength",
                             "maxLength"))
QWEN3_CALL_START, QWEN3_CALL_END = "<tool_call>\n", "\n</tool_call>"
DSML_INVOKE_CLOSE = f"</{DSML}invoke>"


def lark_string(text: str) -> str:
    """A Lark string literal (JSON string escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def lark_text(text: str) -> str:
    """Literal text as a sequence of literals with each newline its own: llguidance's lexer does not backtrack, so
    no literal may start with a newline that a bare newline elsewhere could also match ("\n" vs "\n</x>")."""
    pieces = [p for part in text.split("\n") for p in ("\n", part)][1:]
    return " ".join(lark_string(p) for p in pieces if p)


def lark_regex_literal(text: str) -> str:
    """`text` escaped for a /regex/ terminal."""
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}/-" else "\\n" if c == "\n" else c for c in text)


def until_first(marker: str) -> str:
    """A terminal: any text that ends with the first occurrence of `marker` (the marker included)."""
    m = lark_regex_literal(marker)
    return f"/(.|\\n)*{m}/ & ~/(.|\\n)*{m}(.|\\n)+/"


def json_rule(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({**JSON_OPTIONS, **schema}, ensure_ascii=False)


def parameters_of(tool: dict[str, Any]) -> dict[str, Any]:
    parameters = tool["function"].get("parameters")
    return parameters if isinstance(parameters, dict) and parameters else {"type": "object", "properties": {}}


def raw_string_rule(schema: Any) -> str | None:
    """The DSML value of a string property written as is (string="true", what DeepSeek's encoder writes for every
    string), ending with the parameter's close tag: free text, a length range or one of an enum / const; None for
    string rules a raw value cannot express here (pattern, format: written as JSON, string="false", instead)."""
    if not isinstance(schema, dict) or schema.get("type") != "string" or not set(schema) <= RAW_STRING_KEYS:
        return None
    close = f"</{DSML}parameter>"
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        if not values or not all(isinstance(v, str) and close not in v for v in values):
            return None
        return "(" + " | ".join(lark_string(v + close) for v in values) + ")"
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if not isinstance(low, int) or not (high is None or isinstance(high, int)):
        return None
    m = lark_regex_literal(close)
    return f"/(.|\\n){{{low},{'' if high is None else high}}}{m}/ & ~/(.|\\n)*{m}(.|\\n)+/"


def qwen3_call_rules(tools: list[dict[str, Any]]) -> list[str]:
    rules = []
    for i, tool in enumerate(tools):
        call = {"type": "object", "properties": {"name": {"const": tool["function"]["name"]},
                                                 "arguments": parameters_of(tool)},
                "required": ["name", "arguments"], "additionalProperties": False}
        rules.append(f"call_{i}: {lark_text(QWEN3_CALL_START)} call_json_{i} {lark_text(QWEN3_CALL_END)}\n"
                     f"call_json_{i}: {json_rule(call)}")
    return rules


def dsml_call_rules(tools: list[dict[str, Any]]) -> list[str]:
    rules = []
    for i, tool in enumerate(tools):
        parameters = parameters_of(tool)
        properties = parameters.get("properties") or {}
        required = set(parameters.get("required") or ())
        parts = []
        for j, (key, schema) in enumerate(properties.items()):
            raw = raw_string_rule(schema)
            opening = f'\n<{DSML}parameter name="{key}" string="{"false" if raw is None else "true"}">'
            if raw is not None:
                rules.append(f"P_{i}_{j}: {raw}")
                parts.append(f"({lark_text(opening)} P_{i}_{j})" + ("" if key in required else "?"))
            else:
                rules.append(f"value_{i}_{j}: {json_rule(schema if isinstance(schema, dict) else {})}")
                parts.append(f"({lark_text(opening)} value_{i}_{j} {lark_string(f'</{DSML}parameter>')})"
                             + ("" if key in required else "?"))
        head = lark_string(f'<{DSML}invoke name="{tool["function"]["name"]}">')
        # "\n\n" before the close when no parameter was written (the encoder joins none with newlines around)
        rules.append(f"call_{i}: {head} {' '.join(parts)} {lark_text(chr(10))} {lark_text(chr(10))}? "
                     f"{lark_string(DSML_INVOKE_CLOSE)}")
    return rules


def tool_call_grammar(fmt: ToolCallFormat, tools: list[dict[str, Any]], *, single: bool,
                      reasoning: ReasoningFormat | None, prompt: str) -> str:
    """The Lark grammar of an answer made only of calls to `tools` (OpenAI tool dicts), in format `fmt`."""
    calls = " | ".join(f"call_{i}" for i in range(len(tools)))
    if fmt.name == "qwen3":
        rules = qwen3_call_rules(tools)
        body = "call" if single else 'call ("\\n" call)*'
    else:
        rules = dsml_call_rules(tools)
        body = (lark_text(f"\n\n<{DSML}tool_calls>\n") + (" call" if single else ' call ("\\n" call)*')
                + " " + lark_text(f"\n</{DSML}tool_calls>"))
    lead = ""
    if reasoning is not None:
        if reasoning.starts_inside(prompt):
            lead = "REASONING "
        elif reasoning.opens_in_output and not prompt.rstrip().endswith(reasoning.end):
            lead = f'({lark_string(reasoning.start)} REASONING "\\n" "\\n")? '
        if lead:
            rules.append(f"REASONING: {until_first(reasoning.end)}")
    return "\n".join([f"start: {lead}{body}", f"call: {calls}", *rules]) + "\n"
