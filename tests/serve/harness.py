"""What the server tests share: a server on its own event-loop thread, waiting for states, RPC errors, and
the bad requests every engine must refuse with INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import grpc
import pytest

from appliance.client import ApplianceClient
from appliance.serve.api import appliance_pb2 as pb
from appliance.serve.convert import generate_request
from appliance.serve.server import ApplianceServer
from tests.engine.instrumented import HookedEngine, hooked_runner


def with_server(rc, **changes):
    return dataclasses.replace(rc, server=dataclasses.replace(rc.server, **changes))


class Running:
    """An ApplianceServer on its own event loop thread."""

    def __init__(self, rc, engine):
        self.engine = engine
        self.server = ApplianceServer(rc, engine)
        self.result = None
        self.error = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while self.server.port is None:
            assert time.monotonic() < deadline and self.thread.is_alive(), f"server did not bind: {self.error}"
            time.sleep(0.01)
        self.address = f"127.0.0.1:{self.server.port}"

    def _run(self):
        try:
            self.result = asyncio.run(self.server.run())
        except BaseException as exc:    # noqa: BLE001 - reported by the test
            self.error = exc

    def client(self, **kw) -> ApplianceClient:
        return ApplianceClient(self.address, **kw)

    def stop(self, timeout: float = 20):
        self.server.request_shutdown()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "server did not stop"


def serve_hooked_engine(rc) -> Running:
    """A server around the real engine on a hooked runner (tests/engine/instrumented.py), once SERVING."""
    srv = Running(rc, HookedEngine(rc, hooked_runner(rc.model)))
    wait_for(lambda: srv.server.state != "starting" or not srv.thread.is_alive(), timeout=300, what="engine start")
    assert srv.server.state == "serving", f"server did not start: {srv.error!r}"
    return srv


def wait_for(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def rpc_error(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


# name: (prompt, sampling, the field the refusal names). OUT_OF_VOCAB and TOO_LONG stand for values that
# depend on the engine: a token id equal to its vocab_size, max_tokens equal to its max_model_len.
OUT_OF_VOCAB, TOO_LONG = "<out of vocab>", "<max_model_len>"
BAD_REQUESTS = {
    "empty text": ("", {}, "prompt"),
    "no prompt": (None, {}, "prompt"),
    "empty token ids": ([], {}, "prompt"),
    "token id outside the vocabulary": (OUT_OF_VOCAB, {}, "prompt_token_ids"),
    "max_tokens 0": ("hi", {"max_tokens": 0}, "sampling.max_tokens"),
    "max_tokens negative": ("hi", {"max_tokens": -3}, "sampling.max_tokens"),
    "prompt + max_tokens over max_model_len": ("hi", {"max_tokens": TOO_LONG}, "sampling.max_tokens"),
    "negative temperature": ("hi", {"temperature": -0.5}, "sampling.temperature"),
    "top_p 0": ("hi", {"top_p": 0.0}, "sampling.top_p"),
    "top_p negative": ("hi", {"top_p": -0.25}, "sampling.top_p"),
    "top_p above 1": ("hi", {"top_p": 1.5}, "sampling.top_p"),
    "negative top_k": ("hi", {"top_k": -1}, "sampling.top_k"),
}


def bad_request(name: str, vocab_size: int, max_model_len: int) -> tuple[pb.GenerateRequest, str]:
    """BAD_REQUESTS[name] as a GenerateRequest for an engine of this vocab_size and max_model_len, and its field."""
    prompt, sampling, field = BAD_REQUESTS[name]
    if prompt == OUT_OF_VOCAB:
        prompt = [1, 2, vocab_size]
    sampling = {k: max_model_len if v == TOO_LONG else v for k, v in sampling.items()}
    req = generate_request(prompt if prompt is not None else "x", **sampling)
    if prompt is None:
        req.ClearField("text")
    return req, field


def assert_refused(stub, req: pb.GenerateRequest, field: str) -> None:
    """INVALID_ARGUMENT, the field named in the details and in the invalid-field trailer."""
    err = rpc_error(lambda: list(stub.Generate(req, timeout=10)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert field in err.details()
    assert ("invalid-field", field) in tuple(err.trailing_metadata())
