"""A drain past its grace with the real engine over gRPC: the requests left are aborted and give back their
blocks. The engine loop is held inside a step (tests/engine/instrumented.py), so nothing can finish within the
grace however fast the machine is. A module of its own: its server must not run beside another one."""

from __future__ import annotations

from appliance.config.compose import load_runtime_config
from appliance.core.request import FinishReason
from tests.engine.instrumented import loop_held
from tests.serve.harness import serve_hooked_engine
from tests.serve.test_server import wait_for
from tests.serve.test_server_engine_faults import OVERRIDES
from tests.support.kv import free_blocks, total_blocks


def test_drain_past_its_grace_aborts_the_rest_and_frees_their_blocks():
    srv = serve_hooked_engine(load_runtime_config([*OVERRIDES, "server.grace_period_s=0.2"]))
    engine, runner, client = srv.engine, srv.engine.test_runner, srv.client()
    try:
        streams = [client.generate(f"long story {i}", max_tokens=100, ignore_eos=True) for i in range(2)]
        for stream in streams:
            next(stream)
        with loop_held(runner):           # nothing can finish within the grace
            assert free_blocks(engine) != total_blocks(engine)
            srv.server.request_shutdown()
            # drain() returns once it has aborted what was left (it waits a few seconds for the held loop).
            assert engine.drained.wait(60), "the drain did not return"
            # The held step outlasts grace + 2 s: the server ends the streams itself (ABORTED) and stops.
            lasts = [list(s)[-1] for s in streams]
            assert [last.finish_reason for last in lasts] == [FinishReason.ABORTED] * 2
            assert all(last.usage.completion_tokens < 100 for last in lasts)
        # Once the step ends, the engine finishes the aborts and frees their blocks.
        wait_for(lambda: engine.num_in_flight() == 0 and free_blocks(engine) == total_blocks(engine),
                 60, "the aborted requests' blocks to be freed")
        srv.thread.join(60)
        assert srv.result["status"] == "ok"
    finally:
        if srv.thread.is_alive():
            srv.stop(60)
