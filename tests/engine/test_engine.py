"""Engine: greedy outputs never change with batching, chunking, prefix-cache hits or preemption;
aborted requests give every block back."""

import random
import subprocess
import sys
import textwrap
import threading

import pytest

from appliance.core.request import FinishReason, SamplingParams
from appliance.offline import Appliance
from tests.support.kv import free_blocks, total_blocks

MODELS = {
    "qwen3_tiny": ["+model=qwen3_tiny", "device=cpu", "max_model_len=256"],
    "dsv4_tiny": ["+model=dsv4_tiny", "device=cpu", "max_model_len=256"],
}


def prompts(n, lo, hi, seed=0, vocab=512):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def greedy(max_tokens):
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module", params=list(MODELS))
def reference(request):
    """Each prompt run alone, one at a time, on an engine with prefix caching off."""
    name = request.param
    batch = prompts(10, 1, 90, seed=1)
    with Appliance.from_config(MODELS[name] + ["enable_prefix_caching=false"]) as app:
        alone = [app.generate([p], greedy(24))[0].token_ids for p in batch]
    return name, batch, alone


def test_concurrent_equals_one_at_a_time(reference):
    name, batch, alone = reference
    with Appliance.from_config(MODELS[name] + ["max_num_seqs=16", "decode_batch=4",
                                               "max_num_batched_tokens=64"]) as app:
        results = app.generate(batch, greedy(24))
    assert [r.token_ids for r in results] == alone
    assert all(r.finish_reason is FinishReason.LENGTH and len(r.token_ids) == 24 for r in results)


def test_preemption_keeps_greedy_outputs(reference):
    name, batch, alone = reference
    # Two slots at max_model_len 128: admission only reserves the first chunk, so the requests let in
    # outgrow the full-history pools and the newest must be preempted.
    small = MODELS[name] + ["max_model_len=128", "max_num_seqs=16", "kv_cache.num_slots_override=2"]
    with Appliance.from_config(small) as app:
        results = app.generate(batch, greedy(24))
        preemptions = app.engine.scheduler.num_preemptions
        assert free_blocks(app.engine) == total_blocks(app.engine)
    assert preemptions > 0
    assert [r.token_ids for r in results] == alone


def test_prefix_cache_hits_keep_greedy_outputs(reference):
    name, _, _ = reference
    shared = prompts(1, 70, 70, seed=7)[0]
    tails = prompts(4, 1, 20, seed=8)
    batch = [shared + t for t in tails]
    with Appliance.from_config(MODELS[name] + ["enable_prefix_caching=false"]) as app:
        expected = [app.generate([p], greedy(16))[0].token_ids for p in batch]
    with Appliance.from_config(MODELS[name]) as app:
        first = app.generate([batch[0]], greedy(16))[0]
        rest = app.generate(batch[1:], greedy(16))
    assert first.usage.cached_prompt_tokens == 0
    block = 16
    for r in rest:
        assert r.usage.cached_prompt_tokens == (len(shared) // block) * block
        assert r.usage.prompt_tokens == len(r.prompt_token_ids)
    assert [first.token_ids] + [r.token_ids for r in rest] == expected


def test_abort_mid_stream_frees_every_block(reference):
    name, batch, _ = reference
    with Appliance.from_config(MODELS[name]) as app:
        engine = app.engine
        finals, lock = {}, threading.Lock()
        done = threading.Event()
        seen = {}

        def on_output(out):
            with lock:
                seen[out.request_id] = seen.get(out.request_id, 0) + len(out.new_token_ids)
                if seen[out.request_id] >= 3 and not out.finished:
                    engine.abort(out.request_id)
                if out.finished:
                    finals[out.request_id] = out
                    if len(finals) == len(batch):
                        done.set()

        for i, p in enumerate(batch):
            engine.submit(f"abort-{i}", p, greedy(100), on_output=on_output)
        assert done.wait(120)
        assert all(o.finish_reason is FinishReason.ABORTED for o in finals.values())
        assert all(3 <= seen[r] < 100 for r in finals)
        assert free_blocks(engine) == total_blocks(engine)
        # The engine keeps serving after the aborts.
        again = app.generate([batch[0]], greedy(4))[0]
        assert len(again.token_ids) == 4


def test_stop_rules_and_sampling_seed():
    with Appliance.from_config(MODELS["qwen3_tiny"]) as app:
        p = prompts(1, 10, 10, seed=3)[0]
        base = app.generate([p], greedy(12))[0].token_ids
        stop_tok = base[5]
        first_idx = base.index(stop_tok)
        r = app.generate([p], SamplingParams(max_tokens=12, stop_token_ids=(stop_tok,), ignore_eos=True))[0]
        assert r.finish_reason is FinishReason.STOP and r.token_ids == base[:first_idx + 1]
        s1 = app.generate([p, p], [SamplingParams(max_tokens=12, temperature=1.0, seed=5),
                                   SamplingParams(max_tokens=12, temperature=1.0, seed=5)])
        s2 = app.generate([p], SamplingParams(max_tokens=12, temperature=1.0, seed=5))
        assert s1[0].token_ids == s1[1].token_ids == s2[0].token_ids
        s3 = app.generate([p], SamplingParams(max_tokens=12, temperature=1.0, seed=6))
        assert s3[0].token_ids != s1[0].token_ids


def test_an_aborted_request_id_is_free_at_once():
    """The id leaves the engine when abort returns, not when the loop gets to it; aborting an old handle never
    touches the newer request that reuses its id."""
    with Appliance.from_config(MODELS["qwen3_tiny"]) as app:
        engine = app.engine
        p = prompts(1, 10, 10, seed=4)[0]
        expected = app.generate([p], greedy(6))[0].token_ids
        for _ in range(20):
            old = engine.submit("same", p, greedy(200))
            next(iter(old))                                   # streaming
            old.abort()
            new = engine.submit("same", p, greedy(6))         # no "already in flight"
            old.abort()                                       # a second abort of the old one is a no-op
            outs = list(new)
            assert outs[-1].finish_reason is FinishReason.LENGTH
            assert [t for o in outs for t in o.new_token_ids] == expected
            assert list(old)[-1].finish_reason is FinishReason.ABORTED
        assert engine.num_in_flight() == 0
        assert free_blocks(engine) == total_blocks(engine)


def test_a_front_end_s_stop_counts_only_the_tokens_it_kept():
    """Engine.stop from a front end that found a stop string (split mode): the tokens the loop generated past the
    kept ones are not counted as generated, so generation_tokens is what clients received."""
    import time

    with Appliance.from_config(MODELS["qwen3_tiny"]) as app:
        engine = app.engine
        before = engine.stats()
        outputs = iter(engine.submit("front-stop", prompts(1, 10, 10, seed=5)[0], greedy(200)))
        received = 0
        while received < 3:                                   # streaming: the loop may run ahead of us
            received += len(next(outputs).new_token_ids)
        engine.stop("front-stop", kept_tokens=2)
        deadline = time.monotonic() + 60
        while engine.stats().finished.get("stop", 0) == before.finished.get("stop", 0):
            assert time.monotonic() < deadline, "the loop did not free the stopped request"
            time.sleep(0.01)
        assert engine.stats().generation_tokens - before.generation_tokens == 2
        assert free_blocks(engine) == total_blocks(engine)


def test_an_appliance_left_open_is_closed_before_the_interpreter_exits():
    """A script that never calls close(): the engine loop is stopped by the time later exit handlers run (without
    it, such a process sometimes ended in std::terminate, exit status 134, as the native libraries shut down)."""
    script = textwrap.dedent("""
        import atexit, threading
        from appliance.core.request import SamplingParams
        from appliance.offline import Appliance

        atexit.register(lambda: print("loop alive at exit:",
                                      any(t.name == "engine-loop" and t.is_alive() for t in threading.enumerate())))
        app = Appliance.from_config(["+model=qwen3_tiny"])
        print(len(app.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["2", "loop alive at exit: False"], done.stdout
