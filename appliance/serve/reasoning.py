"""Reasoning split out of a chat answer: the text inside <think>...</think> becomes `reasoning_content`, the rest
`content`, fed one text delta at a time so that streaming and the whole answer split the same way.

Where the rules come from:
- Qwen3 (vLLM's `qwen3` reasoning parser, Qwen3's chat template): the model opens `<think>` itself at the start of
  its answer (with `enable_thinking: false` the template writes an empty `<think>\\n\\n</think>\\n\\n` into the
  prompt instead); `</think>` ends the reasoning.
- DeepSeek V4 (DeepSeek's released encoding, vLLM's `deepseek_v4` reasoning parser): in thinking mode the prompt
  ends with `<｜Assistant｜><think>`, so the answer starts inside the reasoning; in chat mode it ends with
  `</think>` and there is no reasoning. A DSML tool-calls block that starts before `</think>` also ends the
  reasoning (vLLM's DeepSeekV4ThinkingReasoningParser: the model sometimes skips `</think>` at long context).
Whether the answer starts inside a reasoning block is read from the rendered prompt (an open `<think>` at its
end), so a template or kwarg that switches thinking off needs no second switch here. Text is kept as the model
wrote it (vLLM does not strip the newlines around the markers either). Reasoning that never ends (max_tokens)
is all reasoning, in the stream and in the whole answer alike.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningFormat:
    start: str = "<think>"
    end: str = "</think>"
    opens_in_output: bool = True              # the model may write `start` itself at the start of its answer
    implicit_ends: tuple[str, ...] = ()       # markers that end reasoning without `end`; they stay in the content

    def starts_inside(self, prompt: str) -> bool:
        """The rendered prompt leaves a reasoning block open: the answer begins as reasoning."""
        opened = prompt.rfind(self.start)
        return opened >= 0 and prompt.rfind(self.end) < opened


QWEN3_REASONING = ReasoningFormat()
DSV4_REASONING = ReasoningFormat(opens_in_output=False, implicit_ends=("<｜DSML｜tool_calls>",))


def held_prefix_length(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the beginning of a marker: text that must wait for the next
    delta, since it may still turn out to be the marker."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest


@dataclass(frozen=True)
class Split:
    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    """Feed text deltas in order; each returns the reasoning and content it completes (text that may be the start
    of a marker waits for the next delta); finish() returns what was held."""

    def __init__(self, fmt: ReasoningFormat, prompt: str):
        self.fmt = fmt
        self.state = "reasoning" if fmt.starts_inside(prompt) else "opening" if fmt.opens_in_output else "content"
        self.held = ""

    @property
    def in_reasoning(self) -> bool:
        return self.state == "reasoning"

    def feed(self, delta: str) -> Split:
        text = self.held + delta
        self.held = ""
        if self.state == "opening":
            stripped = text.lstrip()
            if stripped.startswith(self.fmt.start):
                self.state = "reasoning"
                text = stripped[len(self.fmt.start):]
            elif self.fmt.start.startswith(stripped):        # only whitespace or part of the marker so far
                self.held = text
                return Split()
            else:
                self.state = "content"
        if self.state == "content":
            return Split(content=text)
        return self._reasoning(text)

    def _reasoning(self, text: str) -> Split:
        ends = [(i, m) for m in (self.fmt.end, *self.fmt.implicit_ends) if (i := text.find(m)) >= 0]
        if ends:
            at, marker = min(ends)
            self.state = "content"
            rest = text[at + len(marker):] if marker == self.fmt.end else text[at:]
            return Split(reasoning=text[:at], content=rest)
        keep = held_prefix_length(text, (self.fmt.end, *self.fmt.implicit_ends))
        self.held = text[len(text) - keep:] if keep else ""
        return Split(reasoning=text[:len(text) - keep])

    def finish(self) -> Split:
        held, self.held = self.held, ""
        if self.state == "reasoning":
            return Split(reasoning=held)
        return Split(content=held)
