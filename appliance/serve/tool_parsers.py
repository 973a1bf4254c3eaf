"""Tool calls parsed out of a chat answer, fed one text delta at a time (the same parser makes the stream and the
whole answer, so they agree), into OpenAI `tool_calls`.

Formats:
- DeepSeek V4 DSML (DeepSeek's released encoding, as vLLM's `deepseek_v4` tool parser reads it): after the answer
  text, `\\n\\n<｜DSML｜tool_calls>\\n` then per call `<｜DSML｜invoke name="NAME">\\n` and per argument
  `<｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>` (string="true": VALUE is the
  string itself; "false": VALUE is JSON), `</｜DSML｜invoke>`, and `</｜DSML｜tool_calls>` closes the block
  (V3.2 named it `function_calls`; V4 renamed it `tool_calls`). Whitespace between the tags is not significant.
- Qwen3 (its chat template's instructions, vLLM's `hermes` parser): `<tool_call>\\n{"name": NAME, "arguments":
  {...}}\\n</tool_call>`, one per call.
A call's arguments are re-serialized JSON (json.dumps, as vLLM does), so they are always a valid JSON object.

What a client sees: text before a call streams as content as it comes; text that may be the start of a call marker
(and whitespace before it, the format's separator) waits for the next delta, so a marker never leaks into content.
A call is emitted once it is complete: first its index, id, type and name with empty arguments, then its
arguments in pieces (one per top-level member) whose concatenation is the arguments string. A call that cannot be
parsed (bad JSON, a missing quote, an unclosed tag when the answer ends) is returned as content from where it
starts, and parsing stops there: never an error. Whitespace-only content after calls is dropped.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from appliance.serve.reasoning import held_prefix_length

DSML = "｜DSML｜"
DSML_BLOCK_START = f"<{DSML}tool_calls>"
DSML_BLOCK_END = f"</{DSML}tool_calls>"
DSML_INVOKE_START = f"<{DSML}invoke name=\""
DSML_INVOKE_END = f"</{DSML}invoke>"
DSML_INVOKE = re.compile(rf'<{DSML}invoke name="([^"<>]*)">(.*?)</{DSML}invoke>', re.DOTALL)
DSML_PARAMETER = re.compile(rf'\s*<{DSML}parameter name="([^"<>]*)" string="(true|false)">(.*?)</{DSML}parameter>',
                            re.DOTALL)
QWEN3_START, QWEN3_END = "<tool_call>", "</tool_call>"


class MalformedCall(ValueError):
    """The text of a call does not follow the format."""


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str          # a JSON object, as a string

    def body(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    """OpenAI-style call ids (vLLM: call_ + 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def argument_pieces(arguments: dict[str, Any]) -> list[str]:
    """json.dumps(arguments) cut after each top-level member: the pieces a stream sends, joined = the whole."""
    if not arguments:
        return ["{}"]
    pieces = [("{" if i == 0 else ", ") + json.dumps(k, ensure_ascii=False) + ": " + json.dumps(v, ensure_ascii=False)
              for i, (k, v) in enumerate(arguments.items())]
    return [*pieces, "}"]


def parse_dsml_invoke(name: str, body: str) -> dict[str, Any]:
    """The arguments of one DSML invoke body: parameters only, each once."""
    arguments: dict[str, Any] = {}
    at = 0
    while at < len(body.rstrip()):
        match = DSML_PARAMETER.match(body, at)
        if match is None:
            raise MalformedCall(f"not a DSML parameter: {body[at:at + 40]!r}")
        key, is_string, value = match.groups()
        if key in arguments:
            raise MalformedCall(f"parameter {key!r} given twice")
        if is_string == "true":
            arguments[key] = value
        else:
            try:
                arguments[key] = json.loads(value)
            except json.JSONDecodeError as exc:
                raise MalformedCall(f"parameter {key!r} is not JSON: {exc}") from None
        at = match.end()
    if not name:
        raise MalformedCall("a call without a name")
    return arguments


def parse_qwen3_call(body: str) -> tuple[str, dict[str, Any]]:
    """The name and arguments of one Qwen3 `<tool_call>` body: a JSON object {"name": ..., "arguments": {...}}."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError as exc:
        raise MalformedCall(f"not JSON: {exc}") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        raise MalformedCall("a call needs a string \"name\"")
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):          # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise MalformedCall(f"arguments are not JSON: {exc}") from None
    if not isinstance(arguments, dict):
        raise MalformedCall("arguments must be a JSON object")
    return call["name"], arguments


@dataclass
class ToolEvents:
    """What one delta completed: content text, and calls as stream deltas (index, id, name, argument pieces)."""

    content: str = ""
    deltas: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class ToolCallFormat:
    """Where calls start in the answer, and how a block of them is read (`dsml` or `qwen3`)."""

    name: str
    start: str

    def read_block(self, text: str) -> tuple[list[tuple[str, dict[str, Any]]], int, str]:
        """The complete calls at the start of `text` (the block's text after its start marker), the characters
        they use, and what follows them: "closed" (the block's end was read too), "pending" (more text may
        complete the next call) or "malformed" (the text after them cannot become a call)."""
        if self.name == "qwen3":
            end = text.find(QWEN3_END)
            if end < 0:
                return [], 0, "pending"
            try:
                return [parse_qwen3_call(text[:end])], end + len(QWEN3_END), "closed"
            except MalformedCall:
                return [], 0, "malformed"
        calls: list[tuple[str, dict[str, Any]]] = []
        at = 0
        while True:
            rest = text[at:].lstrip()
            skipped = len(text) - at - len(rest)
            if rest.startswith(DSML_BLOCK_END):
                return calls, at + skipped + len(DSML_BLOCK_END), "closed"
            match = DSML_INVOKE.match(rest)
            if match is None:
                return calls, at, "pending" if self.pending(rest) else "malformed"
            try:
                calls.append((match.group(1), parse_dsml_invoke(match.group(1), match.group(2))))
            except MalformedCall:
                return calls, at, "malformed"
            at += skipped + match.end()

    def pending(self, rest: str) -> bool:
        """`rest` (whitespace stripped) may still become a call or the block's end."""
        if self.name == "qwen3":
            return True
        return DSML_BLOCK_END.startswith(rest) or DSML_INVOKE_START.startswith(rest) \
            or (rest.startswith(DSML_INVOKE_START) and DSML_INVOKE_END not in rest)

    def only_end_pending(self, rest: str) -> bool:
        """`rest` is at most the unfinished end of a block whose calls are all read (DSML: `</｜DSML｜tool_c`)."""
        stripped = rest.strip()
        return not stripped or (self.name == "dsml" and DSML_BLOCK_END.startswith(stripped))


DSML_TOOL_CALLS = ToolCallFormat("dsml", DSML_BLOCK_START)
QWEN3_TOOL_CALLS = ToolCallFormat("qwen3", QWEN3_START)


class ToolCallParser:
    """Feed content deltas in order; finish() at the end of the answer. `calls` holds every call emitted."""

    def __init__(self, fmt: ToolCallFormat):
        self.fmt = fmt
        self.in_block = False
        self.failed = False
        self.held = ""
        self.separator = ""             # whitespace before the current block's start marker
        self.block_calls = 0            # calls read from the current block
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> ToolEvents:
        events = ToolEvents()
        if self.in_block and not self.failed and self.held and ">" not in delta:
            self.held += delta          # every marker that completes a call or a block ends with ">": wait for one
            return events
        text = self.held + delta
        self.held = ""
        while text:
            if self.failed:
                events.content += text
                break
            text = self._block(text, events) if self.in_block else self._content(text, events)
        return events

    def _content(self, text: str, events: ToolEvents) -> str:
        """Content up to a start marker (the block's text is returned), holding back what may become a marker."""
        at = text.find(self.fmt.start)
        if at >= 0:
            before = text[:at]
            self._emit_content(before.rstrip(), events)
            self.separator = before[len(before.rstrip()):]
            self.in_block, self.block_calls = True, 0
            return text[at + len(self.fmt.start):]
        keep = len(text) - held_prefix_length(text, (self.fmt.start,))
        while keep > 0 and text[keep - 1].isspace():
            keep -= 1
        self._emit_content(text[:keep], events)
        self.held = text[keep:]
        return ""

    def _emit_content(self, text: str, events: ToolEvents) -> None:
        if text and not (self.calls and not text.strip()):
            events.content += text

    def _block(self, text: str, events: ToolEvents) -> str:
        calls, used, after = self.fmt.read_block(text)
        for name, arguments in calls:
            self._emit_call(name, arguments, events)
        if after == "malformed":
            self.failed = True
            return self._unparsed(text[used:].lstrip() if self.block_calls else text)
        if after == "closed":
            self.in_block = False
            return text[used:]
        self.held = text[used:]
        return ""

    def _unparsed(self, text: str) -> str:
        """The text of a block from the call that could not be read: from the block's marker if none was read."""
        return text if self.block_calls else self.separator + self.fmt.start + text

    def _emit_call(self, name: str, arguments: dict[str, Any], events: ToolEvents) -> None:
        call = ToolCall(new_call_id(), name, json.dumps(arguments, ensure_ascii=False))
        index = len(self.calls)
        self.calls.append(call)
        self.block_calls += 1
        events.deltas.append({"index": index, "id": call.id, "type": "function",
                              "function": {"name": name, "arguments": ""}})
        events.deltas.extend({"index": index, "function": {"arguments": piece}} for piece in argument_pieces(arguments))

    def finish(self) -> ToolEvents:
        """The end of the answer: held text is content; an unfinished call is content from where it starts."""
        events = ToolEvents()
        held, self.held = self.held, ""
        if self.in_block and not self.failed:
            if not (self.block_calls and self.fmt.only_end_pending(held)):
                events.content += self._unparsed(held)
        else:
            self._emit_content(held, events)
        return events
