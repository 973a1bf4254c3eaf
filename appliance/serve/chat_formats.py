"""A model's chat format: how messages become its prompt, and how its answers are read back (reasoning markers,
tool-call syntax). Derived from the checkpoint and the architecture, so nothing needs configuring:

- the prompt: the checkpoint's own chat template when it brings one (tokenizer_config.json or chat_template.jinja);
  otherwise DeepSeek V4 models use DeepSeek's released encoder (V4 checkpoints ship Python, not Jinja), which is
  also what the embedded random-weight tiny DeepSeek V4 serves;
- the answer: per architecture, the reasoning and tool-call formats its released models write (vLLM's
  `--reasoning-parser` / `--tool-call-parser` choices for them: deepseek_v4 for DeepSeek V4, qwen3 and hermes for
  Qwen3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from appliance.core.config import ModelSpec
from appliance.serve.chat_template import load_chat_template
from appliance.serve.dsv4_chat import Dsv4ChatFormat
from appliance.serve.reasoning import DSV4_REASONING, QWEN3_REASONING, ReasoningFormat
from appliance.serve.tool_parsers import DSML_TOOL_CALLS, QWEN3_TOOL_CALLS, ToolCallFormat


class ChatRenderer(Protocol):
    """A Jinja ChatTemplate, or a format written in Python (DeepSeek V4's encoder)."""

    @property
    def source(self) -> str: ...

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str: ...


@dataclass(frozen=True)
class ChatFormat:
    renderer: ChatRenderer | None          # None: the model has no chat template (chat completions are refused)
    reasoning: ReasoningFormat | None = None
    tool_calls: ToolCallFormat | None = None


ANSWER_FORMATS: dict[str, tuple[ReasoningFormat, ToolCallFormat]] = {
    "deepseek_v4": (DSV4_REASONING, DSML_TOOL_CALLS),
    "qwen3": (QWEN3_REASONING, QWEN3_TOOL_CALLS),
}


def load_chat_format(model: ModelSpec) -> ChatFormat:
    """The model's chat format (raises ChatTemplateError for a checkpoint template that does not compile)."""
    renderer: ChatRenderer | None = load_chat_template(model)
    if renderer is None and model.arch == "deepseek_v4":
        renderer = Dsv4ChatFormat()
    reasoning, tool_calls = ANSWER_FORMATS.get(model.arch, (None, None))
    return ChatFormat(renderer, reasoning, tool_calls)
