"""POST /v1/chat/completions: the chat rendered in the model's chat format, n choices, reasoning and tool calls
split out of the answer, and tool_choice required or named forced by a grammar.

Rendering and tokenizing run on the executor: a long chat takes time the event loop (health checks, every open
stream) must not wait for. /tokenize renders messages through the same `chat_prompt`, so both agree.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from appliance.core.constraint import OutputConstraint
from appliance.core.request import RequestError, RequestOutput, SamplingParams, validate_prompt_text
from appliance.serve.chat_formats import ChatFormat
from appliance.serve.chat_output import ChatOutputParser
from appliance.serve.chat_template import ChatTemplateError
from appliance.serve.openai.errors import invalid, request_error
from appliance.serve.openai.protocol import ChatCompletionRequest
from appliance.serve.openai.responses import Collected, ResponseShape, chat_logprobs
from appliance.serve.openai.serving import OpenAIServing, request_id
from appliance.serve.openai.streaming import open_choices, respond
from appliance.serve.state import FrontEndState
from appliance.serve.tool_grammar import marker_tokens, parameters_issue, tool_call_grammar

FORCED = ("required", "named")      # tool_choice modes whose answer a grammar constrains to tool calls


class OpenAIServingChat(OpenAIServing):
    def __init__(self, server: FrontEndState, chat_format: ChatFormat | None):
        super().__init__(server)
        self.chat_format = chat_format or ChatFormat(None)

    async def chat_completions(self, body: ChatCompletionRequest, http: Request) -> Response:
        self.check_serving(body.model)
        rid = request_id(http)
        srv = self.server
        renamed = {"prompt": "messages", "max_tokens": body.max_tokens_field}
        tool_mode, named = body.tool_choice_mode()
        fmt = self.chat_format
        if tool_mode in FORCED and fmt.tool_calls is None:
            raise invalid("tool_choice", f"model {self.model!r} ({srv.rc.model.arch}) has no known tool-call format "
                                         f"to force; send \"auto\" or \"none\"")
        if tool_mode in FORCED:        # the call grammar reads every tool's parameters
            for i, tool in enumerate(body.template_tools() or ()):
                issue = parameters_issue(tool["function"].get("parameters"))
                if issue is not None:
                    raise invalid(f"tools[{i}].function.parameters{issue[0]}", issue[1])
        prompt, ids = await self.chat_prompt(body, renamed)
        max_tokens = body.requested_max_tokens()
        params = body.sampling_params(default_max_tokens=max(1, srv.rc.max_model_len - len(ids)))
        if max_tokens is not None:
            params = dataclasses.replace(params, max_tokens=max_tokens)
        if tool_mode in FORCED:
            params = self.force_tool_calls(body, params, prompt, named)
        streams = await open_choices(srv, rid, ids, params, {**renamed, "logprobs": "top_logprobs"}, body.n)
        num_top = body.top_logprobs or 0

        def delta_logprobs(_: int, out: RequestOutput) -> dict[str, Any] | None:
            return chat_logprobs(out.logprobs, num_top, self.token_text) if out.logprobs is not None else None

        tool_calls = fmt.tool_calls if tool_mode != "none" else None
        max_calls = None if body.parallel_tool_calls else 1

        def new_parser() -> ChatOutputParser:
            return ChatOutputParser(prompt, fmt.reasoning, tool_calls, max_calls)

        def render(got: Collected, reason: str | None) -> tuple[dict[str, Any], str | None, dict[str, Any] | None]:
            parser = new_parser()
            parser.feed(got.text)
            parser.finish()
            return (parser.message.body(), parser.finish_reason(reason),
                    chat_logprobs(got.logprobs, num_top, self.token_text) if body.logprobs else None)
        return await respond(srv, http, streams, ResponseShape("chat", rid, self.model), body,
                             render, delta_logprobs, new_parser)

    def force_tool_calls(self, body: ChatCompletionRequest, params: SamplingParams, prompt: str,
                         named: str | None) -> SamplingParams:
        """tool_choice required or named: the answer is constrained to calls in the model's format (the grammar
        engine masks every other token), one call when named or parallel_tool_calls is false."""
        if params.constraint is not None:
            raise invalid("tool_choice", f"{body.tool_choice!r} cannot be combined with response_format or "
                                         f"structured_outputs (both constrain the whole answer)")
        fmt = self.chat_format
        calls = fmt.tool_calls
        if calls is None:              # refused before: chat_completions checks the format first
            raise invalid("tool_choice", f"model {self.model!r} has no known tool-call format to force")
        tools = [t for t in body.template_tools() or () if named is None or t["function"]["name"] == named]
        grammar = tool_call_grammar(calls, tools, single=named is not None or not body.parallel_tool_calls,
                                    reasoning=fmt.reasoning, prompt=prompt,
                                    specials=marker_tokens(calls, fmt.reasoning,
                                                           self.server.engine.tokenizer.token_to_id))
        return dataclasses.replace(params, constraint=OutputConstraint.grammar(grammar, field="tool_choice"))

    async def chat_prompt(self, body: ChatCompletionRequest, renamed: dict[str, str],
                          encode: Callable[[str], list[int]] | None = None) -> tuple[str, list[int]]:
        """The chat rendered in the model's chat format, and tokenized (by `encode`, default the engine's)."""
        renderer = self.chat_format.renderer
        if renderer is None:
            raise invalid("messages", f"model {self.model!r} has no chat template (no chat_template in its "
                                      f"tokenizer_config.json nor a chat_template.jinja): use /v1/completions")
        srv = self.server
        limits = self.limits()
        tokenize = encode or srv.engine.tokenizer.encode
        # Cheap checks first, so that a huge or many-message chat is refused before it is rendered or tokenized.
        kwargs = body.template_kwargs()
        body.refuse_messages_too_long(limits.max_prompt_bytes)
        body.refuse_invalid_unicode()
        messages = [m.template_value(i) for i, m in enumerate(body.messages)]

        tools = body.template_tools()

        def render_and_encode() -> tuple[str, list[int]]:    # on the executor: rendering and tokenizing take time
            text = renderer.render(messages, add_generation_prompt=body.add_generation_prompt, tools=tools, **kwargs)
            validate_prompt_text(text, limits)        # the rendered chat is bounded like a prompt
            return text, tokenize(text)
        try:
            return await asyncio.get_running_loop().run_in_executor(srv.executor, render_and_encode)
        except ChatTemplateError as exc:
            raise invalid("messages", str(exc)) from None
        except RequestError as exc:
            raise request_error(exc, renamed) from None
