"""DeepSeek V4's chat format as released: DeepSeek ships a Python encoder (`encoding/encoding_dsv4.py` in the
checkpoint, mirrored by vLLM as vllm/tokenizers/deepseek_v4_encoding.py and applied by its `deepseek_v4` tokenizer
mode) instead of a Jinja chat template. This renders the same prompt text from OpenAI messages.

The rules, from that encoder and vLLM's wrapper (vllm/tokenizers/deepseek_v4.py):
- `<｜begin▁of▁sentence｜>` first; a system message is its text; a user message is `<｜User｜>` + text.
- After the last user message (and any user message that an assistant message follows) comes `<｜Assistant｜>`
  then `<think>` in thinking mode, else `</think>`. Thinking mode is chat_template_kwargs `thinking` or
  `enable_thinking` (vLLM accepts both); off by default.
- An assistant message is [reasoning + `</think>`] + content + [`\\n\\n` + a DSML tool-calls block] +
  `<｜end▁of▁sentence｜>`. Its reasoning (`reasoning_content`, or vLLM's `reasoning`) is kept only in thinking
  mode and only after the last user message, unless `drop_thinking: false` or the request has tools.
- Tool results (role tool) become `<tool_result>...</tool_result>` blocks of a user message (consecutive ones
  joined by blank lines, ordered as the calls were), since V4 has no tool role.
- Tools go into a system message inserted first (vLLM's wrapper), after its text: the "## Tools" instructions
  with each function's JSON schema on its own line.
- `reasoning_effort: "max"` in thinking mode puts DeepSeek's maximum-effort instruction first.
The whole text is returned; rendering it never raises for well-typed messages (refusals are the caller's).
"""

from __future__ import annotations

import json
from typing import Any

from appliance.serve.chat_template import ChatTemplateError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START, THINK_END = "<think>", "</think>"
DSML = "｜DSML｜"
# Every marker the format writes, for tokenizers that should hold each as one token.
MARKERS = (BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END, DSML)

TOOLS_SECTION = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {start}), you MUST output your complete reasoning inside \
{start}...{end} BEFORE any tool calls or final response.

Otherwise, output directly after {end} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

MAX_EFFORT = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")


def to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def tools_section(tools: list[dict[str, Any]]) -> str:
    schemas = "\n".join(to_json(tool.get("function", tool)) for tool in tools)
    return TOOLS_SECTION.format(dsml=DSML, start=THINK_START, end=THINK_END, schemas=schemas)


def dsml_parameter(key: str, value: Any) -> str:
    is_string = isinstance(value, str)
    text = value if is_string else to_json(value)
    return f'<{DSML}parameter name="{key}" string="{"true" if is_string else "false"}">{text}</{DSML}parameter>'


def dsml_tool_calls(tool_calls: list[dict[str, Any]]) -> str:
    """An assistant message's calls as the DSML block the model writes."""
    invokes = []
    for call in tool_calls:
        function = call.get("function", call)
        arguments = function.get("arguments") or {}
        if isinstance(arguments, str):
            arguments = json.loads(arguments) if arguments.strip() else {}
        params = "\n".join(dsml_parameter(k, v) for k, v in arguments.items())
        invokes.append(f'<{DSML}invoke name="{function["name"]}">\n{params}\n</{DSML}invoke>')
    return f"<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML}tool_calls>"


def merge_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool messages folded into user messages as <tool_result> blocks (V4 has no tool role): a run of user and tool
    messages becomes one user message, its parts joined by blank lines, the results in the order of the calls
    they answer (the encoder's merge_tool_messages and sort_tool_results_by_call_order)."""
    merged: list[dict[str, Any]] = []
    call_order: dict[str, int] = {}
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            call_order = {c["id"]: i for i, c in enumerate(message["tool_calls"]) if c.get("id")}
        part: tuple[int | None, str]
        if role == "tool":
            part = (call_order.get(message.get("tool_call_id") or "", 0),
                    f"<tool_result>{message.get('content') or ''}</tool_result>")
        elif role == "user":
            part = (None, message.get("content") or "")
        else:
            merged.append(dict(message))
            continue
        if merged and merged[-1].get("parts") is not None:
            merged[-1]["parts"].append(part)
        else:
            merged.append({"role": "user", "parts": [part]})
    for message in merged:
        parts = message.pop("parts", None)
        if parts is not None:
            results = iter(sorted((p for p in parts if p[0] is not None), key=lambda p: p[0]))
            message["content"] = "\n\n".join(next(results)[1] if order is not None else text for order, text in parts)
    return merged


def last_user_index(messages: list[dict[str, Any]]) -> int:
    return max((i for i, m in enumerate(messages) if m.get("role") in ("user", "developer")), default=-1)


def reasoning_of(message: dict[str, Any]) -> str:
    return message.get("reasoning_content") or message.get("reasoning") or ""


def render_dsv4(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                thinking: bool = False, drop_thinking: bool = True, reasoning_effort: str | None = None) -> str:
    """The prompt text of a chat (see the module docstring for each rule's source)."""
    if tools:
        messages = [{"role": "system", "content": "", "tools": tools}, *messages]
    messages = merge_tool_results(messages)
    drop = drop_thinking and not tools
    last_user = last_user_index(messages)
    if thinking and drop:        # earlier turns lose their reasoning; developer turns before the last user go
        messages = [m for i, m in enumerate(messages) if m.get("role") != "developer" or i >= last_user]
        last_user = last_user_index(messages)
    prompt = BOS
    if thinking and reasoning_effort == "max":
        prompt += MAX_EFFORT
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content") or ""
        if role == "system":
            prompt += content + ("\n\n" + tools_section(message["tools"]) if message.get("tools") else "")
        elif role in ("user", "developer"):
            prompt += USER + content
        elif role == "assistant":
            if thinking and (not drop or i > last_user):
                prompt += reasoning_of(message) + THINK_END
            prompt += content
            if message.get("tool_calls"):
                prompt += "\n\n" + dsml_tool_calls(message["tool_calls"])
            prompt += EOS
        else:
            raise ChatTemplateError(f"DeepSeek V4's chat format has no role {role!r} (system, user, assistant, tool, "
                                    f"developer)")
        following = messages[i + 1]["role"] if i + 1 < len(messages) else None
        if role in ("user", "developer") and following in (None, "assistant"):
            prompt += ASSISTANT + (THINK_START if thinking and (not drop or i >= last_user) else THINK_END)
    return prompt


class Dsv4ChatFormat:
    """Renders like ChatTemplate.render: chat_template_kwargs thinking / enable_thinking, drop_thinking and
    reasoning_effort are the encoder's options; other kwargs are not used by the format."""

    source = "DeepSeek V4 encoding (encoding_dsv4)"

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        effort = kwargs.get("reasoning_effort")
        return render_dsv4(messages, tools, thinking=bool(kwargs.get("thinking") or kwargs.get("enable_thinking")),
                           drop_thinking=bool(kwargs.get("drop_thinking", True)),
                           reasoning_effort=effort if effort in ("max", "high") else None)
