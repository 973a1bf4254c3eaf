"""Failure paths over gRPC with the real engine (not the fake): every bad request refused with its real field
name, and a runner failing for one request fails that request only (a drain past its grace:
test_server_engine_drain.py, a server of its own). The model runner is the real Qwen3 runner with step hooks (tests/engine/instrumented.py), which can fail the
steps of a chosen request or hold the engine loop inside a step until the test releases it, so nothing here
depends on how fast the machine is."""

from __future__ import annotations

import random
import threading

import grpc
import pytest

from appliance.config.compose import load_runtime_config
from appliance.core.request import FinishReason, SamplingParams
from appliance.offline import Appliance
from tests.engine.instrumented import loop_held
from tests.serve.harness import (
    BAD_REQUESTS,
    assert_refused,
    bad_request,
    rpc_error,
    serve_hooked_engine,
    wait_for,
)
from tests.support.kv import free_blocks, total_blocks

OVERRIDES = ["+model=qwen3_tiny", "device=cpu", "max_model_len=128", "max_num_seqs=8", "decode_batch=8",
             "kv_cache.num_slots_override=8", "server.port=0", "server.http_port=0", "server.grace_period_s=5"]
NEIGHBOUR_TOKENS = 24


@pytest.fixture(scope="module")
def rc():
    return load_runtime_config(OVERRIDES)


@pytest.fixture(scope="module")
def serving(rc):
    srv = serve_hooked_engine(rc)
    yield srv
    srv.stop(60)
    assert srv.result["status"] == "ok"


def all_blocks_free(engine) -> bool:
    return engine.num_in_flight() == 0 and free_blocks(engine) == total_blocks(engine)


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_are_refused_by_the_real_engine_naming_the_field(serving, rc, case):
    req, field = bad_request(case, rc.model.layout.vocab_size, rc.max_model_len)
    assert_refused(serving.client().stub, req, field)
    assert all_blocks_free(serving.engine)


def test_a_request_id_already_in_flight_is_refused_naming_request_id(serving):
    runner, client = serving.engine.test_runner, serving.client()
    first = client.generate("a story", request_id="twice", max_tokens=50, ignore_eos=True)
    assert next(first).request_id == "twice"
    with loop_held(runner):               # "twice" cannot finish while the loop is held
        err = rpc_error(lambda: client.complete("another", request_id="twice", max_tokens=2))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in err.details()
        assert ("invalid-field", "request_id") in tuple(err.trailing_metadata())
    assert list(first)[-1].finish_reason == FinishReason.LENGTH
    wait_for(lambda: all_blocks_free(serving.engine), what="blocks back")


@pytest.mark.expects_failed_steps
@pytest.mark.parametrize("streamed_before_failure", [0, 3])
def test_a_runner_failing_for_one_request_fails_it_alone(serving, rc, streamed_before_failure):
    rng = random.Random(streamed_before_failure)
    vocab = rc.model.layout.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(5, 40))] for _ in range(4)]
    poison = [rng.randrange(3, vocab) for _ in range(20)]
    greedy = SamplingParams(max_tokens=NEIGHBOUR_TOKENS, ignore_eos=True)
    with Appliance.from_config(rc) as plain:
        expected = [r.token_ids for r in plain.generate(prompts, greedy)]
    engine, runner, client = serving.engine, serving.engine.test_runner, serving.client()
    poison_id = f"poison-{streamed_before_failure}"
    # Its steps fail from the prefill on, or from the step that would compute its 4th token.
    runner.fail_from[poison_id] = len(poison) + streamed_before_failure - 1 if streamed_before_failure else 0
    results, errors = {}, {}

    def neighbour(i: int) -> None:
        results[i] = client.complete(prompts[i], request_id=f"neighbour-{streamed_before_failure}-{i}",
                                     max_tokens=NEIGHBOUR_TOKENS, ignore_eos=True)

    def poisoned() -> None:
        deltas = []
        try:
            for delta in client.generate(poison, request_id=poison_id, max_tokens=NEIGHBOUR_TOKENS, ignore_eos=True):
                deltas.append(delta)
        except grpc.RpcError as exc:
            errors["poison"] = (exc, deltas)

    # A gate request keeps the loop stepping (long enough never to finish first: it is cancelled below); while
    # the loop is held, all five requests queue, so they are admitted together and share every step.
    gate = client.generate("gate", max_tokens=100, ignore_eos=True)
    next(gate)
    threads = [threading.Thread(target=neighbour, args=(i,)) for i in range(len(prompts))]
    threads.append(threading.Thread(target=poisoned))
    with loop_held(runner):
        for t in threads:
            t.start()
        wait_for(lambda: engine.num_in_flight() == len(threads) + 1, what="all requests accepted")
    for t in threads:
        t.join(120)
    gate.close()                                                      # cancels the call: its blocks come back

    exc, deltas = errors["poison"]
    assert exc.code() == grpc.StatusCode.INTERNAL and "injected runner failure" in exc.details()
    assert sum(len(d.new_token_ids) for d in deltas) == streamed_before_failure
    shared = [step for step in runner.steps if poison_id in {row[0] for row in step} and len(step) > 1]
    assert shared, "the failing request must have shared a step with its neighbours"
    for i, want in enumerate(expected):
        ids, _, last = results[i]
        assert ids == want, f"neighbour {i} changed because another request failed"
        assert last.finish_reason == FinishReason.LENGTH
    wait_for(lambda: all_blocks_free(engine), what="every block back")
    assert client.health() == "SERVING"
    assert client.complete(prompts[0], max_tokens=NEIGHBOUR_TOKENS, ignore_eos=True)[0] == expected[0]
