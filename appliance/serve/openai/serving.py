"""What every endpoint shares: the server it reads, the model it serves, the serving check, a token's text and the
request's id. Why a base: each endpoint's module (serving_completion, serving_chat, ...) then holds only its own
request-to-response steps, as vLLM's and SGLang's `entrypoints/openai/serving_*` do.
"""

from __future__ import annotations

import uuid

from fastapi import Request

from appliance.core.logs import REQUEST_ID
from appliance.core.request import RequestLimits
from appliance.serve.openai.errors import ApiError
from appliance.serve.state import FrontEndState, ServerState


class OpenAIServing:
    """The handlers' common ground, reading the server's state, engine and executor through `server`."""

    def __init__(self, server: FrontEndState):
        self.server = server
        self.model = server.rc.model.name

    def check_serving(self, model: str | None) -> None:
        """503 unless the server is serving; 404 for another model than the one served."""
        state = self.server.state
        if state is not ServerState.SERVING:
            raise ApiError(503, f"the engine is {state}; retry when GET /health answers 200",
                           type_="service_unavailable")
        if model is not None and model != self.model:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.model!r}",
                           type_="not_found_error", param="model", code="model_not_found")

    def limits(self) -> RequestLimits:
        """The engine's request limits, which its start sets (so they exist once check_serving passed)."""
        limits = self.server.engine.limits
        if limits is None:
            raise ApiError(503, "the engine is starting; retry when GET /health answers 200",
                           type_="service_unavailable")
        return limits

    def token_text(self, token_id: int) -> str:
        """A token as logprobs name it: its text alone (special tokens included)."""
        return self.server.engine.tokenizer.decode([token_id], skip_special_tokens=False)


def request_id(http: Request) -> str:
    """The client's x-request-id, else a fresh one; set for the logs of this request."""
    rid = http.headers.get("x-request-id") or uuid.uuid4().hex
    REQUEST_ID.set(rid)
    return rid
