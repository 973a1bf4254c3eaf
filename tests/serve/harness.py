"""For the server tests with the real engine: a server around it on a hooked runner, and the bad requests it
must refuse with INVALID_ARGUMENT naming the field (the harness itself is test_server.py's)."""

from __future__ import annotations

import grpc

from appliance.core.request import MAX_REQUEST_ID_CHARS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from appliance.serve.api import appliance_pb2 as pb
from appliance.serve.convert import generate_request
from tests.engine.instrumented import HookedEngine, hooked_runner
from tests.serve.test_server import Running, rpc_error, wait_for


def serve_hooked_engine(rc) -> Running:
    """A server around the real engine on a hooked runner (tests/engine/instrumented.py), once SERVING."""
    srv = Running(rc, HookedEngine(rc, hooked_runner(rc.model)))
    wait_for(lambda: srv.server.state != "starting" or not srv.thread.is_alive(), timeout=300, what="engine start")
    assert srv.server.state == "serving", f"server did not start: {srv.error!r}"
    return srv


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
    "NaN temperature": ("hi", {"temperature": float("nan")}, "sampling.temperature"),
    "infinite temperature": ("hi", {"temperature": float("inf")}, "sampling.temperature"),
    "NaN top_p": ("hi", {"top_p": float("nan")}, "sampling.top_p"),
    "empty stop string": ("hi", {"stop": [""]}, "sampling.stop[0]"),
    "second stop string empty": ("hi", {"stop": ["a", ""]}, "sampling.stop[1]"),
    "too many stop strings": ("hi", {"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "sampling.stop"),
    "stop string too long": ("hi", {"stop": ["s" * (MAX_STOP_STRING_CHARS + 1)]}, "sampling.stop[0]"),
    "too many stop token ids": ("hi", {"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))},
                                "sampling.stop_token_ids"),
    "stop token id outside the vocabulary": ("hi", {"stop_token_ids": OUT_OF_VOCAB}, "sampling.stop_token_ids"),
    "request_id with a newline": ("hi", {"request_id": "line\nbreak"}, "request_id"),
    "request_id not ASCII": ("hi", {"request_id": "caf\u00e9"}, "request_id"),
    "request_id too long": ("hi", {"request_id": "r" * (MAX_REQUEST_ID_CHARS + 1)}, "request_id"),
}


def bad_request(name: str, vocab_size: int, max_model_len: int) -> tuple[pb.GenerateRequest, str]:
    """BAD_REQUESTS[name] as a GenerateRequest for an engine of this vocab_size and max_model_len, and its field."""
    prompt, sampling, field = BAD_REQUESTS[name]
    if prompt == OUT_OF_VOCAB:
        prompt = [1, 2, vocab_size]
    sampling = {k: max_model_len if v == TOO_LONG else [vocab_size] if v == OUT_OF_VOCAB else v
                for k, v in sampling.items()}
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
