"""On a CUDA GPU: the engine's greedy tokens equal transformers' on the same GPU (float32, every prompt), for a Qwen3
checkpoint transformers writes itself and for DeepSeek V4 checkpoints with transformers' config.json (the oracles of
tests/engine, on the device). bfloat16 agreement is measured and reported, not required token for token (two correct
bf16 implementations round differently).

Marked `cuda` and skipped without a GPU: `make device-check` runs them (bench/device_check.py), `make test` skips them.
With DEVICE_CHECK_OUT set, each test writes its figures there as JSON (the device check's summary reads them).
DEVICE_CHECK_DEVICE=cpu runs the same tests on the CPU: the check's own logic, where no GPU is at hand.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from appliance.config.compose import load_runtime_config
from appliance.core.request import SamplingParams
from appliance.core.tokenizer import Tokenizer
from appliance.offline import Appliance
from tests.support.checkpoints import dense_twin, dequantize_state, save_checkpoint, write_tiny_checkpoint

DEVICE = os.environ.get("DEVICE_CHECK_DEVICE", "cuda")
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                                   reason="needs a CUDA GPU: make device-check")]
transformers = pytest.importorskip("transformers")

NEW = 32
QWEN3_LENS = (1, 7, 33, 64, 130, 257, 480, 20)
GPU = [f"device={DEVICE}", "max_model_len=640", "max_num_seqs=8", "decode_batch=8"]


def report(name: str, figures: dict) -> None:
    """Write one test's figures for the device check's summary (DEVICE_CHECK_OUT), if asked."""
    out = os.environ.get("DEVICE_CHECK_OUT")
    if out:
        Path(out, f"oracle_{name}.json").write_text(json.dumps(figures, indent=1))


def prompts(lengths, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def transformers_greedy(model_class: str, directory: Path, work: list[list[int]], dtype: torch.dtype) -> list[list[int]]:
    """transformers' `generate` (greedy, NEW tokens, no EOS) on the GPU, one prompt at a time."""
    net = getattr(transformers, model_class).from_pretrained(directory, dtype=dtype).to(DEVICE).eval()
    net.generation_config.eos_token_id = None
    with torch.no_grad():
        out = [net.generate(torch.tensor([p], device=DEVICE), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
               [0, len(p):].tolist() for p in work]
    del net
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return out


def served(directory: Path, work: list[list[int]], *extra: str) -> list[list[int]]:
    """Every prompt at once through `+model=hf model.weights=DIR device=cuda`, greedy."""
    with Appliance.from_config(["+model=hf", f"model.weights={directory}", *GPU, *extra]) as app:
        return [r.token_ids for r in app.generate(work, SamplingParams(max_tokens=NEW, ignore_eos=True))]


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Identical prompts, and the share of tokens before the first difference (a difference changes what follows)."""
    prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(ours, theirs)]
    return {"prompts": len(ours), "identical": sum(x == y for x, y in zip(ours, theirs)),
            "tokens_before_first_difference": sum(prefix) / sum(len(x) for x in ours)}


@pytest.fixture(scope="module")
def qwen3_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """One tiny Qwen3 written by transformers (config.json and weights: Qwen3ForCausalLM.save_pretrained, seeded
    initialisation), float32 and bfloat16, each with a locally built tokenizer.json."""
    config = transformers.Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(5)
    net = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():                   # larger than the default init: logits far from uniform, fewer near-ties
        for p in net.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    out = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        directory = tmp_path_factory.mktemp(f"qwen3_{name}")
        net.to(dtype).save_pretrained(directory)
        Tokenizer.build(config.vocab_size).save(directory / "tokenizer.json")
        out[name] = directory
    return out


def test_qwen3_float32_greedy_on_the_gpu_equals_transformers_on_the_gpu(qwen3_checkpoints):
    work = prompts(QWEN3_LENS, 512, seed=1)
    ours, theirs = served(qwen3_checkpoints["float32"], work), transformers_greedy(
        "Qwen3ForCausalLM", qwen3_checkpoints["float32"], work, torch.float32)
    report("qwen3_float32", agreement(ours, theirs))
    assert ours == theirs


def test_qwen3_bfloat16_agreement_with_transformers_on_the_gpu(qwen3_checkpoints):
    work = prompts(QWEN3_LENS, 512, seed=2)
    ours, theirs = served(qwen3_checkpoints["bfloat16"], work), transformers_greedy(
        "Qwen3ForCausalLM", qwen3_checkpoints["bfloat16"], work, torch.bfloat16)
    figures = agreement(ours, theirs)
    report("qwen3_bfloat16", figures)
    assert figures["tokens_before_first_difference"] >= 0.5     # bf16 rounding differs; the model must not


def dsv4_checkpoint(directory: Path, seed: int) -> Path:
    """DeepSeek V4 with transformers' config.json (window, CSA 4, HCA 16 layers, YaRN, 2 indexer heads, a hash
    layer) and seeded weights with the released names, as tests/engine/test_engine_dsv4_hf.py writes them."""
    from tests.engine.test_engine_dsv4_hf import CONFIGS, write_checkpoint
    args, serving = CONFIGS["c16_yarn_no_hash_chunked"]
    return write_checkpoint(directory, args, seed=seed, serving=serving)


def test_dsv4_float32_greedy_on_the_gpu_equals_transformers_on_the_gpu(tmp_path):
    from tests.engine.test_engine_dsv4_hf import CONFIGS
    directory = dsv4_checkpoint(tmp_path / "dsv4", seed=31)
    work = prompts((1, 7, 45, 130, 333, 480), 512, seed=3)
    ours = served(directory, work, *CONFIGS["c16_yarn_no_hash_chunked"][1])
    theirs = transformers_greedy("DeepseekV4ForCausalLM", directory, work, torch.float32)
    report("dsv4_float32", agreement(ours, theirs))
    assert ours == theirs


def test_dsv4_fp8_linears_and_fp4_experts_on_the_gpu_equal_transformers_on_the_dequantized_twin(tmp_path):
    """The accelerator's MoE path (stacked experts, dequantized for the step) with FP4 experts and FP8 linears."""
    from safetensors.torch import load_file
    model = load_runtime_config(["+model=dsv4_tiny", "model.layout.quant_block_size=32",
                                 "model.layout.expert_dtype=fp4", "model.layout.index_num_heads=16"]).model
    quantized = write_tiny_checkpoint(tmp_path / "fp8_fp4", model, seed=12, std=0.1)
    dense = save_checkpoint(tmp_path / "dense", dense_twin(model),
                            dequantize_state(load_file(str(quantized / "model.safetensors")), model))
    work = prompts((5, 60, 300), 512, seed=4)
    ours = served(quantized, work)
    theirs = transformers_greedy("DeepseekV4ForCausalLM", dense, work, torch.float32)
    report("dsv4_fp8_fp4", agreement(ours, theirs))
    assert ours == theirs


def test_engine_oracle_workload_on_the_gpu(tmp_path):
    """tests/engine/test_engine_oracles.py's workload on the GPU (prefix hits, chunked prefill and preemption
    all happen), against transformers on the GPU."""
    from tests.engine.test_engine_oracles import NEW_TOKENS, workload
    model = load_runtime_config(["+model=qwen3_tiny"]).model
    directory = write_tiny_checkpoint(tmp_path / "qwen3", model, seed=7, std=0.1)
    work = workload(model.layout.vocab_size)
    pressure = [f"device={DEVICE}", "max_model_len=128", "max_num_seqs=16", "decode_batch=4",
                "max_num_batched_tokens=32", "kv_cache.num_slots_override=2"]
    with Appliance.from_config(["+model=hf", f"model.weights={directory}", *pressure]) as app:
        first = app.generate(work[:1], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        rest = app.generate(work[1:], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        preempted = app.engine.scheduler.num_preemptions
    ours = [r.token_ids for r in first + rest]
    net = transformers.Qwen3ForCausalLM.from_pretrained(directory, dtype=torch.float32).to(DEVICE).eval()
    net.generation_config.eos_token_id = None
    with torch.no_grad():
        theirs = [net.generate(torch.tensor([p], device=DEVICE), max_new_tokens=NEW_TOKENS, do_sample=False,
                               pad_token_id=0)[0, len(p):].tolist() for p in work]
    report("engine_workload", agreement(ours, theirs) | {"preemptions": preempted,
                                                          "cached_prompt_tokens": sum(r.usage.cached_prompt_tokens
                                                                                      for r in rest)})
    assert preempted > 0 and any(r.usage.cached_prompt_tokens for r in rest)
    assert ours == theirs


@pytest.mark.skipif(DEVICE != "cuda", reason="the Triton kernel on the GPU (the CPU runs it interpreted elsewhere)")
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_paged_decode_kernel_on_the_gpu_equals_attention_over_gathered_pages(dtype, tolerance):
    from npu.paged_attention_triton import triton_decode_attention
    from tests.npu.test_paged_attention_triton import gathered_attention
    heads, kv_heads, dim, block, num_pages = 32, 8, 128, 16, 64
    kernel = triton_decode_attention(torch.device("cuda"), dtype, heads, kv_heads, dim, block)
    gen = torch.Generator(device="cuda").manual_seed(1)
    planes = torch.randn(2 * num_pages, block, kv_heads * dim, generator=gen, device="cuda").to(dtype)
    lengths = torch.tensor([1, 16, 17, 200, 511], device="cuda")
    pages = torch.stack([torch.randperm(num_pages, device="cuda")[:32] for _ in range(5)])
    q = torch.randn(5, heads, dim, generator=gen, device="cuda").to(dtype)
    got = kernel(q, planes, pages, lengths).float().cpu()
    want = gathered_attention(q.cpu(), planes.cpu(), pages.cpu(), lengths.cpu(), block, kv_heads)
    report(f"triton_kernel_{str(dtype).removeprefix('torch.')}", {"max_abs_error": (got - want).abs().max().item()})
    assert torch.allclose(got, want, atol=tolerance, rtol=tolerance)


@pytest.mark.skipif(DEVICE != "cuda", reason="the Triton kernel on the GPU (the CPU runs it interpreted elsewhere)")
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_paged_prefill_kernel_on_the_gpu_equals_attention_over_gathered_pages(dtype, tolerance):
    """Chunks after cached tokens at the Qwen3-8B layout's head shape: 3 chunks of 300 tokens ending at 1,000."""
    from npu.prefill_attention_triton import triton_prefill_attention
    from tests.npu.test_prefill_attention_triton import gathered_attention, pool_and_pages
    heads, kv_heads, dim, block, chunks, context, length = 32, 8, 128, 16, 3, 1000, 300
    kernel = triton_prefill_attention(torch.device("cuda"), dtype, heads, kv_heads, dim, block)
    planes, pages, gen = pool_and_pages(chunks, context, block, kv_heads, dim, dtype, seed=2)
    q = torch.randn(chunks * length, heads * dim, generator=gen).to(dtype)
    got = kernel.paged(q.cuda(), planes.cuda(), pages.cuda(), context, length, checked=True).double().cpu()
    want = gathered_attention(q, planes, pages, context, length, block, heads, kv_heads)
    report(f"triton_prefill_kernel_{str(dtype).removeprefix('torch.')}",
           {"max_abs_error": (got - want).abs().max().item()})
    assert not got.isnan().any() and torch.allclose(got, want, atol=tolerance, rtol=tolerance)


@pytest.mark.skipif(DEVICE != "cuda", reason="the Triton kernel on the GPU (the CPU runs it interpreted elsewhere)")
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_dsv4_attention_kernel_on_the_gpu_equals_the_softmax_with_a_sink(dtype, tolerance):
    """DeepSeek V4's real head shape (64 heads x 512): a window part of 128 rows and 512 indexer picks per query."""
    from npu.deepseek_v4.attention_triton import KeyRows, sparse_attention
    from tests.npu.test_dsv4_attention_triton import reference
    S, Q, H, d, pages, rows = 2, 3, 64, 512, 64, 64
    gen = torch.Generator().manual_seed(3)
    pool = torch.randn(pages, rows, d, generator=gen).to(dtype)
    parts = [KeyRows(pool, torch.randint(0, pages, (S, 128), generator=gen), torch.randint(0, rows, (S, 128),
                     generator=gen), torch.rand(S, Q, 128, generator=gen) < 0.9),
             KeyRows(pool, torch.randint(0, pages, (S, Q, 512), generator=gen), torch.randint(0, rows, (S, Q, 512),
                     generator=gen), torch.rand(S, Q, 512, generator=gen) < 0.9)]
    q, sink = torch.randn(S, Q, H, d, generator=gen).to(dtype), torch.randn(H, generator=gen)
    on_gpu = [KeyRows(p.pool.cuda(), p.page.cuda(), p.row.cuda(), p.mask.cuda()) for p in parts]
    got = sparse_attention(q.cuda(), sink.cuda(), on_gpu).double().cpu()
    want = reference(q, sink, parts)
    report(f"triton_dsv4_attention_{str(dtype).removeprefix('torch.')}",
           {"max_abs_error": (got - want).abs().max().item()})
    assert torch.allclose(got, want, atol=tolerance, rtol=tolerance)


@pytest.mark.skipif(DEVICE != "cuda", reason="the Triton kernel on the GPU (the CPU runs it interpreted elsewhere)")
@pytest.mark.parametrize("fmt,block", [("plain", 0), ("fp8", 128), ("fp4", 32)])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_grouped_gemm_kernel_on_the_gpu_equals_each_group_dequantized(fmt, block, dtype, tolerance):
    """The grouped GEMM compiled for the GPU (the CPU tests run Triton's interpreter) on decode-like and prefill-like
    row counts over 32 groups, some empty."""
    from npu.grouped_gemm_triton import triton_grouped_gemm
    from tests.npu.test_grouped_gemm_triton import reference, stack
    gen = torch.Generator().manual_seed(5)
    weights = [torch.randn(384, 512, generator=gen) * 0.05 for _ in range(32)]
    held = stack([w.to(dtype) if fmt == "plain" else w for w in weights], fmt, block)
    worst = 0.0
    for rows_total in (96, 3000):
        ids = torch.randint(0, 24, (rows_total,), generator=gen).sort().values      # groups 24..31 get no rows
        sizes = torch.bincount(ids, minlength=32).tolist()
        rows = torch.randn(rows_total, 512, generator=gen).to(dtype)
        ends = torch.tensor(sizes).cumsum(0).to(torch.int32)
        on_gpu = held.to("cuda") if fmt == "plain" else type(held)(held.name, held.values.cuda(), held.scale.cuda(),
                                                                      held.block)
        got = triton_grouped_gemm(rows.cuda(), on_gpu, ends.cuda()).double().cpu()
        want = reference(rows, held, sizes)
        worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
        assert torch.allclose(got, want, atol=tolerance * want.abs().max(), rtol=tolerance)
    report(f"grouped_gemm_{fmt}_{str(dtype).removeprefix('torch.')}", {"max_rel_error": worst})


@pytest.mark.skipif(DEVICE != "cuda", reason="recorded graphs need a GPU")
def test_recorded_decode_graphs_give_the_eager_steps_logits():
    from npu.qwen3.runner import Qwen3Runner
    from npu.step import SeqStep, StepBatch
    model = load_runtime_config(["+model=qwen3_tiny"]).model
    runners = []
    for graphs in (False, True):
        r = Qwen3Runner(model, "cuda")
        r.load_weights()
        r.allocate_pools({"kv": 64}, 8)
        if graphs:
            assert "recorded as device graphs" in r.capture_graphs(8, record=True, max_model_len=256)
        runners.append(r)
    rng = random.Random(0)
    seqs = [(f"r{i}", [rng.randrange(3, 500) for _ in range(rng.randint(1, 100))], [8 * i + j for j in range(8)])
            for i in range(5)]
    for r in runners:
        for name, tokens, table in seqs:
            r.execute(StepBatch([SeqStep(name, tokens, 0, {"kv": table}, sample=False)], new_pages={"kv": table}))
    worst = 0.0
    for step in range(8):
        batch = StepBatch([SeqStep(name, [rng.randrange(3, 500)], len(tokens) + step, {"kv": table})
                           for name, tokens, table in seqs[:5 - step % 3]])
        eager, replayed = (r.execute(batch) for r in runners)
        worst = max(worst, (eager - replayed).abs().max().item())
        assert eager.argmax(-1).tolist() == replayed.argmax(-1).tolist()
    report("decode_graphs", {"max_abs_logit_difference": worst})
    assert worst < 1e-3
