"""A chat answer's text as OpenAI's assistant message: reasoning split out first, then tool calls parsed out of
the rest (vLLM's order: the tool parser sees only the content after the reasoning). One object per choice, fed the
engine's text deltas; the stream sends the deltas it returns, the whole answer is what they add up to.

Reasoning goes out under both names: `reasoning_content` (DeepSeek's API and vLLM before 0.15) and `reasoning`
(vLLM since it renamed the field, RFC vllm-project/vllm#27755). A message has `tool_calls` only when the model made
calls; then a finish of "stop" is reported as "tool_calls" (as vLLM does), and empty content is null.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from appliance.serve.reasoning import ReasoningFormat, ReasoningSplitter
from appliance.serve.tool_parsers import ToolCall, ToolCallFormat, ToolCallParser


@dataclass
class AssistantMessage:
    """The parts of one answer, accumulated from the deltas."""

    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    def body(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant",
                                   "content": self.content or (None if self.tool_calls else self.content)}
        if self.reasoning is not None:
            message["reasoning_content"] = message["reasoning"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [call.body() for call in self.tool_calls]
        return message


class ChatOutputParser:
    """Text deltas in, OpenAI chat deltas out ({"content"}, {"reasoning_content", "reasoning"}, {"tool_calls"})."""

    def __init__(self, prompt: str, reasoning: ReasoningFormat | None, tools: ToolCallFormat | None,
                 max_calls: int | None = None):
        self.reasoning = ReasoningSplitter(reasoning, prompt) if reasoning is not None else None
        self.tools = ToolCallParser(tools) if tools is not None else None
        self.max_calls = max_calls          # parallel_tool_calls false: calls after the first are dropped (as vLLM)
        self.message = AssistantMessage()

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.reasoning is None:
            return self._content(text, final=False)
        split = self.reasoning.feed(text)
        return self._reasoning(split.reasoning) + self._content(split.content, final=False)

    def finish(self) -> list[dict[str, Any]]:
        """The deltas held back until the end of the answer."""
        if self.reasoning is None:
            return self._content("", final=True)
        split = self.reasoning.finish()
        return self._reasoning(split.reasoning) + self._content(split.content, final=True)

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        self.message.reasoning = (self.message.reasoning or "") + text
        return [{"reasoning_content": text, "reasoning": text}]

    def _content(self, text: str, final: bool) -> list[dict[str, Any]]:
        if self.tools is None:
            content, calls = text, []
        else:
            events = self.tools.feed(text) if text else None
            tail = self.tools.finish() if final else None
            content = (events.content if events else "") + (tail.content if tail else "")
            calls = (events.deltas if events else []) + (tail.deltas if tail else [])
        deltas: list[dict[str, Any]] = []
        if content:
            self.message.content += content
            deltas.append({"content": content})
        deltas.extend({"tool_calls": [call]} for call in calls
                      if self.max_calls is None or call["index"] < self.max_calls)
        if self.tools is not None:
            self.message.tool_calls = list(self.tools.calls[:self.max_calls])
        return deltas

    def finish_reason(self, reason: str | None) -> str | None:
        """The engine's stop with calls made is OpenAI's "tool_calls"; length stays length."""
        return "tool_calls" if reason == "stop" and self.message.tool_calls else reason
