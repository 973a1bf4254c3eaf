"""bench/workload_ceiling.py: its arithmetic per token is what torch's FLOP counter counts in transformers' Qwen3 on
the same checkpoint, its bytes per step are the checkpoint's projection and head weights, the roofline takes the
longer of the two per step, and the script prints the workloads with each measured system's share of the ceiling.
No time is compared: the rates are the machine's."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from appliance.config.compose import load_runtime_config
from tests.conftest import REPO
from tests.support.checkpoints import write_tiny_checkpoint

sys.path.insert(0, str(REPO / "bench"))

from workload_ceiling import Dense, Rates, offline_floor, served_floor  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    model = load_runtime_config(["+model=qwen3_tiny"]).model
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ceiling"), model, seed=0)


def dense(ckpt) -> Dense:
    return Dense.of(json.loads((ckpt / "config.json").read_text()), 4)


@pytest.mark.parametrize("context", [1, 9, 30])
def test_a_decode_tokens_arithmetic_is_what_torch_counts_in_transformers(ckpt, context):
    transformers = pytest.importorskip("transformers")
    from torch.utils.flop_counter import FlopCounterMode

    # eager attention: its q.k and p.v are matmuls the counter sees (it has no formula for CPU's fused SDPA)
    model = transformers.Qwen3ForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    ids = torch.randint(3, 200, (1, context))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        if "cache" in inspect.signature(model.forward).parameters:      # transformers >= 5.2x renamed it
            cached = {"cache": out.cache}
        else:
            cached = {"past_key_values": out.past_key_values}
        with FlopCounterMode(display=False) as counter:
            model(torch.tensor([[5]]), use_cache=True, **cached)
    m = dense(ckpt)
    # the new token attends over the context and itself, and its logits take the head once
    assert counter.get_total_flops() == m.token_flops(context + 1) + 2 * m.head_weights


def test_a_steps_bytes_are_the_checkpoints_projection_and_head_weights(ckpt):
    state = {}
    for f in ckpt.glob("*.safetensors"):
        state.update(load_file(f))
    read = sum(t.numel() * t.element_size() for name, t in state.items()
               if t.dim() == 2 and "embed_tokens" not in name)          # the embedding's rows are gathered, not read
    m = dense(ckpt)
    assert read == m.all_weight_bytes
    assert m.kv_read(10) == 2 * m.layers * m.kv_heads * m.head_dim * 10 * 4


def test_each_step_is_the_longer_of_its_arithmetic_and_its_bytes(ckpt):
    m = dense(ckpt)
    slow_memory, slow_math = Rates(peak=1e30, dram=1.0), Rates(peak=1.0, dram=1e30)
    prompt, gen, requests = 7, 5, 3
    # bytes alone: one read of the weights per prefill step, and per decode step the weights and every row's K and V
    prefill, decode = offline_floor(m, slow_memory, requests, prompt, gen, chunk=8)
    assert prefill == pytest.approx(3 * m.all_weight_bytes)               # 21 prompt tokens in steps of 8
    assert decode == pytest.approx(sum(m.all_weight_bytes + requests * m.kv_read(prompt + s) for s in range(1, gen)))
    # arithmetic alone: every prompt token causally, every decode row with its logits
    prefill, decode = offline_floor(m, slow_math, requests, prompt, gen, chunk=8)
    assert prefill == pytest.approx(requests * (sum(m.token_flops(k) for k in range(1, prompt + 1))
                                                + 2 * m.head_weights))
    assert decode == pytest.approx(requests * sum(m.token_flops(prompt + s) + 2 * m.head_weights
                                                  for s in range(1, gen)))
    # served: a cycle is every stream's prefill arithmetic plus gen - 1 steps of all streams
    assert served_floor(m, slow_memory, 4, prompt, gen) == pytest.approx(
        (gen - 1) * (m.all_weight_bytes + 4 * m.kv_read(prompt + gen / 2)))


def test_the_script_sets_each_system_against_the_ceiling(ckpt):
    run = subprocess.run([sys.executable, "bench/workload_ceiling.py", "--model", str(ckpt), "--requests", "4",
                          "--prompt-len", "16", "--gen-len", "8", "--concurrency", "1,4", "--threads", "1",
                          "--stream-mib", "16", "--matmul-n", "128", "--rate-runs", "1",
                          "--measured", "a=10,b=5", "--served-measured", "4:a=3"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    offline = re.search(r"^\| offline 4 x 16 -> 8 \| [\d.e-]+ \([\d.e-]+ \+ [\d.e-]+\) \| ([\d,]+) \| (.*) \|$",
                        run.stdout, re.M)
    assert offline, run.stdout
    ceiling = float(offline.group(1).replace(",", ""))
    assert "a 10 (" in offline.group(2) and "a / b 2.00x" in offline.group(2)
    at_most = float(re.search(r"at most ([\d.]+)x", offline.group(2)).group(1))
    assert at_most == pytest.approx(ceiling / 5, abs=0.11)      # b at the ceiling: the most a can lead it by
    assert re.search(r"^\| served, concurrency 1, 16 -> 8 \| .* \|  \|$", run.stdout, re.M), run.stdout
    assert re.search(r"^\| served, concurrency 4, 16 -> 8 \| .* \| a 3 \(", run.stdout, re.M), run.stdout
