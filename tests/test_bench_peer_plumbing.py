"""The peer benchmarks' plumbing without running a system: shapes, cold and warm calls, a row per concurrency.
A full run takes minutes and the vLLM venv; a wrong key or name would only show at its end."""

from __future__ import annotations

import json
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))

import bench_peers  # noqa: E402  (bench/ is not a package)
import bench_serve_peers  # noqa: E402
import peer_shapes  # noqa: E402


def test_shapes_parse_in_order_and_the_default_keeps_its_checkpoint_names():
    assert [s.name for s in peer_shapes.parse_shapes("6x768, 4x512")] == ["6x768", "4x512"]
    assert peer_shapes.SHAPES["4x512"].checkpoint_name("bfloat16") == "qwen3-tiny-bf16"
    assert peer_shapes.SHAPES["8x2048kv1"].checkpoint_name("float32") == "qwen3-8x2048kv1-fp32"
    with pytest.raises(SystemExit, match="4x513"):
        peer_shapes.parse_shapes("4x513")


def test_a_checkpoint_of_another_shape_is_refused(tmp_path):
    shape = peer_shapes.SHAPES["6x768"]
    path = tmp_path / shape.checkpoint_name("float32")
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "hidden_size": 512}))
    with pytest.raises(SystemExit, match="is not shape 6x768"):
        peer_shapes.checkpoint(tmp_path, shape, "float32")


def test_the_warm_workload_follows_the_cold_one_with_fresh_prompts():
    calls = bench_peers.QUICK.calls()
    cold, warm = calls[0], calls[1]
    assert (cold["name"], warm["name"]) == ("workload-cold", "workload-warm")
    assert cold["gen_len"] == warm["gen_len"] and len(cold["prompts"]) == len(warm["prompts"])
    assert not {tuple(p) for p in cold["prompts"]} & {tuple(p) for p in warm["prompts"]}
    seconds = {c["name"]: {"seconds": 1.0, "output_tokens": 100} for c in calls}
    assert {"cold_tok_s", "warm_tok_s"} <= set(bench_peers.QUICK.metrics(seconds))


def test_serve_peers_has_a_row_per_concurrency_with_scaled_requests():
    args = bench_serve_peers.argparse.Namespace(requests=None, input_len=128, output_len=64,
                                                concurrency=bench_serve_peers.parse_concurrency("1,8,32"))
    works = bench_serve_peers.workloads(args)
    assert [(w.concurrency, w.requests) for w in works] == [(1, 8), (8, 32), (32, 128)]
    result = bench_serve_peers.ClientResult(8, 0, 100.0, 50.0, 5.0, ("x",))
    sessions = [bench_serve_peers.Session(system, 0, "4x512", (0, 0, 0), (0, 0, 0), 1.0,
                                          {("vllm bench serve", w.concurrency): result for w in works})
                for system in bench_serve_peers.SYSTEMS]
    rows = bench_serve_peers.table(sessions, ["vllm bench serve"], works)[2:]
    assert [row.split(" | ")[1:4] for row in rows] == [
        [str(w.concurrency), str(w.requests), system] for w in works for system in bench_serve_peers.SYSTEMS]
    assert bench_serve_peers.agreement(sessions) == "3 of 3"


def test_each_runs_figure_is_a_share_of_its_own_runs_ceiling(capsys):
    shape = peer_shapes.SHAPES["4x512"]
    args = bench_peers.argparse.Namespace(dtypes=["bfloat16"])
    ceilings = {"bfloat16": [{"offline_tok_s": 1000.0, "peak_gflops": 400.0, "dram_gbps": 30.0},
                             {"offline_tok_s": 800.0, "peak_gflops": 380.0, "dram_gbps": 28.0}]}
    results = {("appliance", "bfloat16"): [{}, {}], ("vllm", "bfloat16"): [{"error": "rc=1"}, {}]}
    metrics = {("appliance", "bfloat16"): [{"cold_tok_s": 500.0, "warm_tok_s": 600.0},
                                          {"cold_tok_s": 480.0, "warm_tok_s": 400.0}],
               ("vllm", "bfloat16"): [{"cold_tok_s": 400.0, "warm_tok_s": 320.0}]}    # its run 1 failed
    bench_peers.report_ceiling(shape, results, ceilings, metrics, ["appliance", "vllm"], args)
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| bfloat16 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells == ["bfloat16", "900 [800-1,000]", "390 [380-400]", "29.0 [28.0-30.0]",
                     "55% [50%-60%] / 55% [50%-60%]",        # 500 / 1,000 and 480 / 800; 600 / 1,000 and 400 / 800
                     "50% / 40%",                            # vLLM's run 2 against run 2's ceiling only
                     "2.00x / 2.50x"]                        # 800 / 400 and 800 / 320


def test_each_served_figure_is_a_share_of_its_own_runs_ceiling():
    args = bench_serve_peers.argparse.Namespace(requests=None, input_len=128, output_len=128,
                                                concurrency=bench_serve_peers.parse_concurrency("1,32"))
    works = bench_serve_peers.workloads(args)
    tok_s = {("appliance", 0): (50.0, 400.0), ("vLLM", 0): (40.0, 320.0),
             ("appliance", 1): (45.0, 450.0), ("vLLM", 1): (30.0, 400.0),
             ("appliance", 2): (60.0, 600.0), ("vLLM", 2): (50.0, 500.0)}      # run 3's ceiling failed
    sessions = [bench_serve_peers.Session(system, run, "6x768", (0, 0, 0), (0, 0, 0), 1.0, {
        ("vllm bench serve", w.concurrency): bench_serve_peers.ClientResult(8, 0, tok_s[(system, run)][i], 1.0, 1.0)
        for i, w in enumerate(works)}) for (system, run) in tok_s]
    ceilings = [{"served_tok_s": {"1": 100.0, "32": 800.0}}, {"served_tok_s": {"1": 60.0, "32": 500.0}},
                {"error": "run3-6x768: workload_ceiling rc=1"}]
    rows = bench_serve_peers.ceiling_table(sessions, ceilings, ["vllm bench serve"], works)[2:]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert cells == [
        ["vllm bench serve", "1", "80 [60-100]", "62% [50%-75%]", "45% [40%-50%]", "2.25x [2.00x-2.50x]"],
        ["vllm bench serve", "32", "650 [500-800]", "70% [50%-90%]", "60% [40%-80%]", "1.88x [1.25x-2.50x]"]]
