"""The OpenAI API's request bodies (pydantic models FastAPI validates the JSON against) and their translation to
the engine's SamplingParams.

Strict where the OpenAI spec is strict: `"stream": "yes"` or `"max_tokens": true` is a 400, not a guess (an integer
is still accepted where a number is expected). A top-level field the models do not declare (a typo) is a 400 naming
it, and declared ones the engine cannot honour (penalties, logit_bias, suffix, echo with stream) are refused
likewise: nothing is silently ignored (inside a chat message, keys other than role, content, name, tool_calls,
tool_call_id and reasoning still are). Beyond OpenAI: top_k, ignore_eos, stop_token_ids and structured_outputs (as
vLLM accepts them). `response_format` and `structured_outputs` become the request's OutputConstraint
(appliance/serve/structured.py); so does `tool_choice` "required" or a named function
(appliance/serve/tool_grammar.py).
Of vLLM's extensions the benchmark clients send: repetition_penalty 1.0 (`vllm bench serve`) and
stream_options.continuous_usage_stats (GuideLLM).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

from appliance.core.constraint import ConstraintError
from appliance.core.request import SamplingParams, lone_surrogate_at
from appliance.serve.chat_template import RENDERER_NAMES
from appliance.serve.openai.errors import invalid
from appliance.serve.structured import (
    ConstraintFieldError,
    JsonSchemaFormat,
    ResponseFormat,
    StructuredOutputs,
    request_constraint,
)

# Documented request limit (README "Request limits"): more messages are refused before any is validated or
# rendered, so a body of many tiny messages costs the event loop no more than parsing it.
MAX_CHAT_MESSAGES = 4096
# Documented request limit: choices per request (n); each is an engine request, bounded by the wait queue too.
MAX_CHOICES = 128


def lone_surrogate_path(value: Any, path: str) -> str | None:
    """The first string (or dict key) under value that holds a lone surrogate, as a field path; iterative, so
    deeply nested JSON cannot exhaust the stack."""
    stack = [(path, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            if lone_surrogate_at(item) is not None:
                return where
        elif isinstance(item, dict):
            for key, inner in reversed(item.items()):
                if isinstance(key, str) and lone_surrogate_at(key) is not None:
                    return where
                stack.append((f"{where}.{key}", inner))
        elif isinstance(item, list):
            stack.extend((f"{where}[{i}]", inner) for i, inner in reversed(list(enumerate(item))))
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True)


class _Request(_Strict):
    """A request body: a field the server does not declare is refused, naming it (never silently ignored)."""

    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False     # vLLM's: with include_usage, every chunk carries the usage so far


class SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                     # 0 or -1: no top-k cut
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0    # vLLM's; `vllm bench serve` sends 1.0 (no penalty) in every request
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None          # OpenAI: text, json_object, json_schema
    structured_outputs: StructuredOutputs | None = None    # vLLM's extension: json, regex, choice, grammar

    def refuse_unsupported(self) -> None:
        if not 1 <= self.n <= MAX_CHOICES:
            raise invalid("n", f"{self.n} must be in [1, {MAX_CHOICES}]")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise invalid(name, "penalties are not supported (send 0)")
        if self.repetition_penalty != 1.0:
            raise invalid("repetition_penalty", "penalties are not supported (send 1.0)")
        if self.logit_bias:
            raise invalid("logit_bias", "logit_bias is not supported")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats (GuideLLM asks for it): usage in every chunk, only with include_usage."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        self.refuse_unsupported()
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        try:
            constraint = request_constraint(self.response_format, self.structured_outputs)
        except (ConstraintFieldError, ConstraintError) as exc:
            raise invalid(exc.field, str(exc).removeprefix(f"{exc.field}: ")) from None
        return SamplingParams(
            max_tokens=default_max_tokens if self.max_tokens is None else self.max_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=0 if self.top_k == -1 else self.top_k,
            seed=self.seed, stop=tuple(s for s in stop if s), stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos, constraint=constraint)


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None        # N: each token's logprob and the N most likely (with echo: the prompt's too)
    suffix: str | None = None

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) back, nothing generated (lm-eval's scoring)."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """logprobs N asks the engine for the sampled tokens' logprobs and, with echo, the prompt's. echo with
        max_tokens 0 runs the prompt and one token, which the response leaves out (as vLLM does)."""
        if self.echo and self.stream:
            raise invalid("echo", "echo with stream is not supported; send stream: false")
        params = super().sampling_params(default_max_tokens)
        return dataclasses.replace(params, max_tokens=1 if self.echo_only else params.max_tokens,
                                   logprobs=self.logprobs,
                                   prompt_logprobs=self.logprobs if self.echo and self.logprobs is not None else None)

    def single_prompt(self) -> str | list[int]:
        """The one prompt (text or token ids); a batch of several prompts is refused."""
        if self.suffix:
            raise invalid("suffix", "suffix is not supported")
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return cast("str | list[int]", p)      # validated: a list that starts with an id holds only ids
        if len(p) != 1:
            raise invalid("prompt", f"a batch of {len(p)} prompts: send one prompt per request")
        return cast("str | list[int]", p[0])


class ContentPart(_Strict):
    """One part of a message's content; only {"type": "text", "text": "..."} is served."""

    type: str
    text: str | None = None


class FunctionCallIn(_Strict):
    name: str
    arguments: str                     # a JSON object as a string (what the API returned)


class ToolCallIn(_Strict):
    """A call in an earlier assistant message, as the API returned it."""

    id: str | None = None
    type: str = "function"
    function: FunctionCallIn


class ChatMessage(_Strict):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None        # assistant: the calls it made
    tool_call_id: str | None = None                   # tool: the call this result answers
    reasoning_content: str | None = None              # assistant: its reasoning (DeepSeek's name)
    reasoning: str | None = None                      # the same under vLLM's name

    def text_chars(self) -> int:
        """Characters of text this message brings to the chat (a character is at least one byte)."""
        content = self.content if isinstance(self.content, list) else [ContentPart(type="text", text=self.content)]
        calls = sum(len(c.function.name) + len(c.function.arguments) for c in self.tool_calls or ())
        return (len(self.role) + len(self.name or "") + sum(len(part.text or "") for part in content) + calls
                + len(self.reasoning_content or self.reasoning or "") + len(self.tool_call_id or ""))

    def template_value(self, index: int) -> dict[str, Any]:
        """The message as chat templates read it; content parts of type text are joined; tool calls' arguments
        as objects (templates iterate them; vLLM parses them likewise); reasoning under both of its names."""
        content = self.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text":
                    raise invalid(f"messages[{index}].content[{j}].type",
                                  f"{part.type!r}: only text content parts are supported")
                if part.text is None:
                    raise invalid(f"messages[{index}].content[{j}].text", "a text part needs a string \"text\"")
            content = "".join(part.text or "" for part in content)
        value: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name:
            value["name"] = self.name
        if self.tool_calls:
            value["tool_calls"] = [{"id": call.id, "type": call.type, "function": {
                "name": call.function.name, "arguments": json_object(call.function.arguments,
                                                                     f"messages[{index}].tool_calls[{j}].function"
                                                                     f".arguments")}}
                for j, call in enumerate(self.tool_calls)]
        if self.tool_call_id is not None:
            value["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            value["reasoning_content"] = value["reasoning"] = reasoning
        return value


def json_object(text: str, param: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise invalid(param, f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise invalid(param, "must be a JSON object")
    return value


class FunctionDefinition(BaseModel):
    """A tool's function; keys beyond OpenAI's reach the template as given."""

    model_config = ConfigDict(strict=True, extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


def _at_most_messages(value: Any) -> Any:
    """Counted before pydantic validates each message (its max_length counts after validating them all)."""
    if isinstance(value, list) and len(value) > MAX_CHAT_MESSAGES:
        raise PydanticCustomError("too_many_messages", "{count} messages; at most {limit}",
                                  {"count": f"{len(value):,}", "limit": MAX_CHAT_MESSAGES})
    return value


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], BeforeValidator(_at_most_messages)]
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True             # false: at most one call (the first, or the one forced)
    logprobs: bool = False
    top_logprobs: int | None = None

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as templates read them (OpenAI's JSON shape), or None without tools."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None

    def tool_choice_mode(self) -> tuple[str, str | None]:
        """("none" | "auto" | "required" | "named", the named function): OpenAI's default is auto with tools, none
        without; required and named need tools, and a named function must be one of them."""
        choice = self.tool_choice
        if choice is None:
            return ("auto" if self.tools else "none"), None
        if isinstance(choice, str):
            if choice == "required" and not self.tools:
                raise invalid("tool_choice", "\"required\" needs tools")
            return choice, None
        names = [tool.function.name for tool in self.tools or ()]
        if choice.function.name not in names:
            raise invalid("tool_choice", f"the function {choice.function.name!r} is not among the tools "
                                         f"({', '.join(map(repr, names)) or 'none given'})")
        return "named", choice.function.name

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs", "needs logprobs: true")
        params = super().sampling_params(default_max_tokens)
        return dataclasses.replace(params, logprobs=(self.top_logprobs or 0) if self.logprobs else None)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        """The name the client used for the completion length, for errors about it."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs, refusing the names the renderer sets itself (messages, tools, bos_token...)."""
        reserved = sorted(RENDERER_NAMES.intersection(self.chat_template_kwargs))
        if reserved:
            raise invalid("chat_template_kwargs", f"{reserved[0]!r} is set by the server (reserved: "
                                                  f"{', '.join(sorted(RENDERER_NAMES))}); send messages, tools and "
                                                  f"add_generation_prompt as top-level fields")
        return self.chat_template_kwargs

    def refuse_messages_too_long(self, max_prompt_bytes: int) -> None:
        """Message text that alone exceeds the prompt byte bound is refused before anything is rendered."""
        if not self.messages:
            raise invalid("messages", "must not be empty")
        chars = sum(m.text_chars() for m in self.messages)
        if chars > max_prompt_bytes:
            raise invalid("messages", f"{chars:,} characters of message text (at least as many bytes) cannot fit "
                                      f"in the model's context: at most {max_prompt_bytes:,} bytes")

    def refuse_invalid_unicode(self) -> None:
        """A lone surrogate anywhere the template may render it, named by its field path."""
        for i, message in enumerate(self.messages):
            bad = lone_surrogate_path(message.model_dump(exclude_none=True), f"messages[{i}]")
            if bad:
                raise invalid(bad, "contains a lone surrogate (e.g. \\ud800): send valid Unicode text")
        for name, value in (("tools", self.template_tools()), ("chat_template_kwargs", self.chat_template_kwargs)):
            bad = lone_surrogate_path(value, name)
            if bad:
                raise invalid(bad, "contains a lone surrogate (e.g. \\ud800): send valid Unicode text")


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a prompt (as /v1/completions tokenizes it), or chat messages (rendered as
    /v1/chat/completions renders them)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], BeforeValidator(_at_most_messages)] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    tools: list[ToolDefinition] | None = None
    add_special_tokens: bool = False   # True: the BOS token first (neither completions route adds it to a prompt)
    return_token_strs: bool = False

    def chat(self) -> ChatCompletionRequest:
        """The messages as a chat request, so they are checked and rendered exactly as chat completions are."""
        return ChatCompletionRequest(messages=self.messages or [], add_generation_prompt=self.add_generation_prompt,
                                     chat_template_kwargs=self.chat_template_kwargs, tools=self.tools)


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


def request_field_names() -> frozenset[str]:
    """Every field name of the request models, to tell them from union members in pydantic error locations."""
    models: list[type[BaseModel]] = [CompletionRequest, ChatCompletionRequest, ChatMessage, ContentPart, StreamOptions,
                                     TokenizeRequest, DetokenizeRequest, ResponseFormat, JsonSchemaFormat,
                                     StructuredOutputs, ToolCallIn, FunctionCallIn, ToolDefinition, FunctionDefinition,
                                     NamedToolChoice, NamedFunction]
    return frozenset(name for model in models for name in model.model_fields) | {"json", "schema"}
