"""End to end with the real engine: the server in-process (to read the engine's block counts) and as
`python -m appliance` (what users run): Startup equals the allocation, many concurrent streams give the
offline greedy outputs, cancel frees blocks, status codes, startup_report.json, SIGTERM exits 0."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from appliance.client import ApplianceClient  # noqa: E402
from appliance.config.compose import load_runtime_config  # noqa: E402
from appliance.core.request import FinishReason, SamplingParams  # noqa: E402
from appliance.engine.engine import Engine  # noqa: E402
from appliance.offline import Appliance  # noqa: E402
from appliance.serve.api import appliance_pb2 as pb  # noqa: E402
from appliance.serve.convert import generate_request  # noqa: E402
from appliance.serve.server import ApplianceServer  # noqa: E402
from tests.support.kv import free_blocks, total_blocks

REPO = Path(__file__).resolve().parents[2]
OVERRIDES = ["device=cpu", "max_model_len=128", "max_num_seqs=8", "kv_cache.num_slots_override=16",
             "server.port=0", "server.http_port=0", "server.grace_period_s=5"]
MAX_TOKENS = 12


def token_prompts(n: int, vocab: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 40))] for _ in range(n)]


def wait_for(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# -- in-process: the server around a real Engine -------------------------------------------------------

@pytest.fixture(scope="module")
def live():
    rc = load_runtime_config(OVERRIDES)
    engine = Engine(rc)
    server = ApplianceServer(rc, engine)
    box = {}

    def run():
        try:
            box["result"] = asyncio.run(server.run())
        except BaseException as exc:    # noqa: BLE001 - reported below
            box["error"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_for(lambda: server.state != "starting" or not thread.is_alive(), timeout=300, what="engine start")
    assert server.state == "serving", f"server did not start: {box.get('error')!r}"
    client = ApplianceClient(f"127.0.0.1:{server.port}")
    assert client.health() == "SERVING"
    yield rc, engine, server, client
    server.request_shutdown()
    thread.join(60)
    client.close()
    assert box.get("result", {}).get("status") == "ok"


def test_startup_equals_the_engine_allocation(live):
    rc, engine, _, client = live
    r = client.startup(timeout=10)
    assert {g.name: g.num_blocks for g in r.cache_groups} == total_blocks(engine)
    specs = {s.name: s for s in rc.model.cache_groups}
    for g in r.cache_groups:
        assert g.num_blocks == r.capacity_slots * specs[g.name].max_blocks_per_seq
        assert g.page_size_bytes == specs[g.name].page_size_bytes
    assert r.model_name == rc.model.name and r.max_model_len == rc.max_model_len
    assert r.capacity_slots >= 1 and r.devices and r.devices[0].total_bytes > 0


def test_concurrent_streams_equal_offline_greedy_outputs(live):
    rc, engine, _, client = live
    batch = token_prompts(24, rc.model.layout.vocab_size)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    with Appliance.from_config(OVERRIDES) as offline:
        expected = [(r.token_ids, r.text) for r in offline.generate(batch, greedy)]
    got: dict[int, tuple] = {}

    def one(i: int) -> None:
        ids, text, last = client.complete(batch[i], max_tokens=MAX_TOKENS, ignore_eos=True)
        got[i] = (ids, text, last.finish_reason, last.usage)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(batch))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got[i][:2] for i in range(len(batch))] == expected
    assert all(got[i][2] == FinishReason.LENGTH and got[i][3].completion_tokens == MAX_TOKENS
               and got[i][3].prompt_tokens == len(batch[i]) for i in range(len(batch)))
    wait_for(lambda: free_blocks(engine) == total_blocks(engine), what="blocks back")


def test_cancel_frees_blocks_in_the_engine(live):
    _, engine, _, client = live
    stream = client.generate("tell me a long story", max_tokens=100, ignore_eos=True)
    next(stream)
    assert free_blocks(engine) != total_blocks(engine)
    stream.close()
    wait_for(lambda: engine.num_in_flight() == 0, what="abort")
    wait_for(lambda: free_blocks(engine) == total_blocks(engine), what="blocks back")


def test_a_cancelled_request_id_is_free_again_when_its_call_ends(live):
    _, engine, _, client = live
    for _ in range(30):
        stream = client.generate("tell me a long story", max_tokens=100, ignore_eos=True, request_id="retry")
        next(stream)
        stream.close()                                # cancel, then reuse the id once the server has seen the end
        # (close() returns before the cancellation reaches the server; on a busy host the next call can overtake it)
        wait_for(lambda: engine.num_in_flight() == 0, what="the cancelled call's end reaching the engine")
        ids, _, last = client.complete("tell me a long story", max_tokens=2, ignore_eos=True, request_id="retry")
        assert len(ids) == 2 and last.finish_reason == FinishReason.LENGTH
    wait_for(lambda: free_blocks(engine) == total_blocks(engine), what="blocks back")


def test_a_prompt_too_big_to_fit_is_refused_before_tokenizing(live):
    rc, engine, _, client = live
    bound = engine.limits.max_prompt_bytes
    assert bound == (rc.max_model_len - 1) * engine.tokenizer.max_token_bytes
    with pytest.raises(grpc.RpcError) as info:
        client.complete("a" * (15 << 20), max_tokens=1)          # 15 MiB: under the 16 MiB message limit
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{15 << 20:,} bytes of text" in info.value.details() and f"at most {bound:,} bytes" in info.value.details()
    assert client.health() == "SERVING"


def test_invalid_requests_with_the_real_engine(live):
    rc, _, _, client = live
    cases = [(dict(prompt=""), "prompt"),
             (dict(prompt=[rc.model.layout.vocab_size]), "prompt_token_ids"),
             (dict(prompt="hi", max_tokens=rc.max_model_len), "sampling.max_tokens"),
             (dict(prompt="hi", temperature=-1.0), "sampling.temperature")]
    for kw, field in cases:
        with pytest.raises(grpc.RpcError) as info:
            client.complete(kw.pop("prompt"), **kw)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in info.value.details()


# -- the CLI process -------------------------------------------------------------------------------------

class ServerProcess:
    """`python -m appliance ...` with its output collected by a thread (so the pipe never fills)."""

    def __init__(self, *overrides: str, run_dir: Path):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "appliance", *overrides, f"hydra.run.dir={run_dir}"], cwd=REPO,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"})
        self.lines: list[str] = []
        self.address: str | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("listening on "):
                self.address = line.split()[2]

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_address(self, timeout: float = 60) -> str:
        wait_for(lambda: self.address or self.proc.poll() is not None, timeout, "listening line")
        assert self.address, self.output
        return self.address


def test_cli_server_process(tmp_path):
    run_dir = tmp_path / "run"
    srv = ServerProcess(*OVERRIDES, "max_num_seqs=2", "max_waiting_requests=2", run_dir=run_dir)
    try:
        client = ApplianceClient(srv.wait_address())
        wait_for(lambda: "SERVING on" in srv.output or srv.proc.poll() is not None, 300, "SERVING")
        assert srv.proc.poll() is None, srv.output
        assert client.health("appliance.v1.Appliance") == "SERVING"
        r = client.startup(timeout=10)
        written = json.loads((run_dir / "startup_report.json").read_text())
        assert {g["name"]: g["num_blocks"] for g in written["plan"]["groups"]} == \
            {g.name: g.num_blocks for g in r.cache_groups}
        assert "capacity_slots" in srv.output

        # 2 running + 2 waiting fill the engine; the fifth request is refused.
        calls = [client.stub.Generate(generate_request("fill", max_tokens=100, ignore_eos=True)) for _ in range(4)]
        for call in calls:
            assert dict(call.initial_metadata())["request-id"]     # sent once the engine accepted it
        with pytest.raises(grpc.RpcError) as info:
            client.complete("one too many", max_tokens=2)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for call in calls[1:]:
            call.cancel()

        srv.proc.send_signal(signal.SIGTERM)           # the remaining stream finishes or is aborted
        last = list(calls[0])[-1]
        assert last.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_ABORTED)
        assert srv.proc.wait(60) == 0, srv.output
        assert "stopped" in srv.output
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
