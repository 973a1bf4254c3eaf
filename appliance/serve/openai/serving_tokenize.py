"""POST /tokenize and POST /detokenize in vLLM's shapes. Messages are rendered by the chat endpoint's own
`chat_prompt`, so a count here is the count a chat completion of the same messages submits."""

from __future__ import annotations

import asyncio
from typing import Any

from appliance.core.request import RequestError, validate_prompt_text
from appliance.serve.openai.errors import ApiError, invalid, request_error
from appliance.serve.openai.protocol import DetokenizeRequest, TokenizeRequest
from appliance.serve.openai.serving import OpenAIServing
from appliance.serve.openai.serving_chat import OpenAIServingChat


class OpenAIServingTokenization(OpenAIServing):
    def __init__(self, chat: OpenAIServingChat):
        super().__init__(chat.server)
        self.chat = chat

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's /tokenize: {count, max_model_len, tokens, token_strs (each token's text, when asked)}."""
        self.check_serving(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "send either prompt or messages")
        tokenizer = self.server.engine.tokenizer

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_bos=True) if body.add_special_tokens else tokenizer.encode(text)
        loop = asyncio.get_running_loop()
        if body.prompt is not None:
            try:
                validate_prompt_text(body.prompt, self.limits())
            except RequestError as exc:
                raise request_error(exc, {}) from None
            ids = await loop.run_in_executor(self.server.executor, encode, body.prompt)
        else:
            _, ids = await self.chat.chat_prompt(body.chat(), {"prompt": "messages"}, encode)
        token_strs = None
        if body.return_token_strs:      # one decode per id: on the executor, as the encoding
            token_strs = await loop.run_in_executor(self.server.executor, lambda: [self.token_text(i) for i in ids])
        return {"count": len(ids), "max_model_len": self.server.rc.max_model_len, "tokens": ids,
                "token_strs": token_strs}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        """vLLM's /detokenize: {prompt: the tokens' text}. Checked and decoded on the executor: a million ids take
        a second, which the event loop (health checks, every stream) must not wait for."""
        self.check_serving(body.model)
        vocab = self.limits().vocab_size
        tokenizer = self.server.engine.tokenizer

        def decode() -> str:
            bad = [t for t in body.tokens if not 0 <= t < vocab]
            if bad:
                raise invalid("tokens", f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
            return tokenizer.decode(body.tokens)
        return {"prompt": await asyncio.get_running_loop().run_in_executor(self.server.executor, decode)}
