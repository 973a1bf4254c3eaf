"""GET /v1/models (the one model served) and GET /health (200 only while serving, for load balancers' probes)."""

from __future__ import annotations

import time
from typing import Any

from fastapi.responses import JSONResponse, Response

from appliance.serve.openai.serving import OpenAIServing
from appliance.serve.state import FrontEndState, ServerState


class OpenAIServingModels(OpenAIServing):
    def __init__(self, server: FrontEndState):
        super().__init__(server)
        self.created = int(time.time())

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model, "object": "model", "created": self.created,
                                            "owned_by": "appliance", "root": self.model, "parent": None,
                                            "max_model_len": self.server.rc.max_model_len}]}

    async def health(self) -> Response:
        state = self.server.state
        return JSONResponse({"status": state}, status_code=200 if state is ServerState.SERVING else 503)
