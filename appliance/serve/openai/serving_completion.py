"""POST /v1/completions: one prompt (text or token ids) and n choices, with vLLM's logprobs and echo.

echo with max_tokens 0 returns the prompt (and its logprobs) and nothing generated: lm-eval's scoring requests.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from appliance.core.request import RequestOutput, TokenLogprob
from appliance.serve.openai.protocol import CompletionRequest
from appliance.serve.openai.responses import Collected, ResponseShape, completion_logprobs
from appliance.serve.openai.serving import OpenAIServing, request_id
from appliance.serve.openai.streaming import open_choices, respond

# Engine field names -> the completion request's fields, for the engine's refusals.
RENAMED = {"prompt": "prompt", "logprobs": "logprobs", "prompt_logprobs": "logprobs"}


class OpenAIServingCompletion(OpenAIServing):
    async def completions(self, body: CompletionRequest, http: Request) -> Response:
        self.check_serving(body.model)
        rid = request_id(http)
        prompt = body.single_prompt()
        params = body.sampling_params(default_max_tokens=16)
        streams = await open_choices(self.server, rid, prompt, params, RENAMED, body.n)
        token_text = self.token_text
        offsets = [0] * body.n

        def delta_logprobs(index: int, out: RequestOutput) -> dict[str, Any] | None:
            if body.logprobs is None:
                return None
            part = completion_logprobs(out.logprobs or (), out.new_token_ids, token_text, offsets[index])
            offsets[index] += sum(len(t) for t in part["tokens"])
            return part

        def render(got: Collected, reason: str | None) -> tuple[str, str | None, dict[str, Any] | None]:
            text, ids = got.text, list(got.token_ids)
            entries: list[TokenLogprob | None] = list(got.logprobs)     # the prompt's first one is None
            if body.echo_only:
                text, ids, entries = "", [], []
            if body.echo:
                text = (prompt if isinstance(prompt, str) else self.server.engine.tokenizer.decode(prompt)) + text
                ids, entries = [*got.prompt_token_ids, *ids], [*got.prompt_logprobs, *entries]
            if body.logprobs is None:
                return text, reason, None
            return text, reason, completion_logprobs(entries, ids, token_text)
        return await respond(self.server, http, streams, ResponseShape("completion", rid, self.model), body,
                             render, delta_logprobs)
