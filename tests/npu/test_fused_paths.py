"""Attention stays on the paths accelerators fuse.

- SDPA gets a bool mask or is_causal, never an additive float mask (torch_npu keeps its fused kernel only
  for a bool mask or none). Recorded at the torch-function level: on CPU, torch's composite SDPA turns a
  bool mask into a float one before dispatch, so a dispatch mode would see float whatever the runner
  passed; an accelerator backend receives the mask as passed.
- Every index_select / index reads a contiguous tensor (recorded by a TorchDispatchMode, where the real
  source of each op is seen), so no step materializes a strided view of a pool layer.
- On an NPU the runner attends with torch_npu's fused paged-attention kernel (npu.fused_attention); here a
  reference implementation of the kernel's documented semantics stands in for it, and the runner's output
  through it must equal its SDPA path's.
"""

import random
import types

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from appliance.config.compose import load_runtime_config
from npu.fused_attention import MASK_SIZE, FusedPagedAttention, fused_attention_op
from npu.qwen3 import Qwen3Runner
from npu.step import SeqStep, StepBatch
from tests.npu import fake_torch_npu


class SdpaMasks(TorchFunctionMode):
    """attn_mask dtype (None when there is none) and is_causal of every scaled_dot_product_attention call."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[torch.dtype | None, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            self.calls.append((None if mask is None else mask.dtype, bool(kwargs.get("is_causal", False))))
        return func(*args, **kwargs)


class IndexSources(TorchDispatchMode):
    """For every index_select / index: whether its source is contiguous, and whether it reads pool storage."""

    def __init__(self, pools):
        super().__init__()
        self.pool_ptrs = {p.untyped_storage().data_ptr() for p in pools}
        self.reads: list[tuple[str, tuple[int, ...], bool, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.startswith(("index_select", "index.")):
            src = args[0]
            self.reads.append((func.__name__, tuple(src.shape), src.is_contiguous(),
                               src.untyped_storage().data_ptr() in self.pool_ptrs))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def runner():
    rc = load_runtime_config(["+model=qwen3_tiny"])
    r = Qwen3Runner(rc.model, "cpu")
    r.load_weights()
    return r


def cached_history(runner, rng):
    """Pages holding a 13-token and a 3-token history (prefilled alone), for steps that read cached tokens."""
    runner.allocate_pools({"kv": 64}, 2)
    histories = {"cached": ([rng.randrange(3, 500) for _ in range(13)], [0, 1, 2]),
                 "dec": ([rng.randrange(3, 500) for _ in range(3)], [3]),
                 "long": ([rng.randrange(3, 500) for _ in range(40)], [4, 5, 6])}
    for name, (tokens, pages) in histories.items():
        runner.execute(StepBatch([SeqStep(name, tokens, 0, {"kv": pages}, sample=False)]))
    return histories


def mixed_step(rng):
    """Decode rows of different contexts, chunks from position 0 (two of equal length), a chunk after cached
    tokens: every attention path of the runner in one step."""
    seqs = [SeqStep("cached", [rng.randrange(3, 500) for _ in range(8)], 13, {"kv": [0, 1, 2]}),
            SeqStep("dec", [7], 3, {"kv": [3]}), SeqStep("long", [9], 40, {"kv": [4, 5, 6]})]
    page = 10
    for i, n in enumerate([16, 7, 16]):
        pages = list(range(page, page + -(-n // 16)))
        page += len(pages)
        seqs.append(SeqStep(f"f{i}", [rng.randrange(3, 500) for _ in range(n)], 0, {"kv": pages}, sample=i != 1))
    return StepBatch(seqs)


def test_sdpa_masks_are_bool_and_index_sources_contiguous(runner):
    rng = random.Random(1)
    cached_history(runner, rng)
    batch = mixed_step(rng)
    masks, sources = SdpaMasks(), IndexSources(runner.pools.values())
    with masks, sources:
        runner.execute(batch)
    layers = runner.model.layout.num_layers
    assert masks.calls and all(dtype in (None, torch.bool) for dtype, _ in masks.calls), masks.calls
    assert sum(1 for dtype, _ in masks.calls if dtype is torch.bool) >= 2 * layers   # decode + cached chunk masks
    assert sum(1 for _, causal in masks.calls if causal) >= layers                    # chunks from position 0
    assert sources.reads and all(contiguous for _, _, contiguous, _ in sources.reads), sources.reads
    pool_reads = [r for r in sources.reads if r[3]]
    assert len(pool_reads) == 2 * layers        # one gather per layer for the decode bucket, one for the cached chunk
    plane = (runner.block_size, runner.num_kv_heads * runner.head_dim)
    assert all(shape[1:] == plane for _, shape, _, _ in pool_reads)   # a layer's planes: [2 x pages, block, kv width]


def reference_fused_infer_attention_score(query, key, value, *, atten_mask, block_table, input_layout, block_size,
                                          actual_seq_lengths, actual_seq_lengths_kv, num_heads, num_key_value_heads,
                                          scale, sparse_mode):
    """torch_npu.npu_fused_infer_attention_score as its documentation states it, for the arguments the runner
    uses (TND query, paged key/value [blocks, block_size, kv_heads x head_dim], sparse_mode 3: each sequence
    causal from the bottom right, with the compressed 2048 x 2048 mask, True = masked out)."""
    assert (input_layout, sparse_mode) == ("TND", 3)
    assert query.is_contiguous() and key.is_contiguous() and value.is_contiguous()
    assert key.shape == value.shape and key.shape[1:] == (block_size, num_key_value_heads * query.shape[-1])
    assert block_table.dtype == torch.int32 and block_table.shape[0] == len(actual_seq_lengths)
    assert atten_mask.dtype == torch.bool and atten_mask.shape == (MASK_SIZE, MASK_SIZE)
    assert torch.equal(atten_mask, torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool).triu(1))
    hd, group = query.shape[-1], num_heads // num_key_value_heads
    out, start = torch.empty_like(query), 0
    for b, (end, kv_len) in enumerate(zip(actual_seq_lengths, actual_seq_lengths_kv)):
        blocks = block_table[b, :-(-kv_len // block_size)].long()
        k = key[blocks].reshape(-1, num_key_value_heads, hd)[:kv_len].repeat_interleave(group, 1)
        v = value[blocks].reshape(-1, num_key_value_heads, hd)[:kv_len].repeat_interleave(group, 1)
        q = query[start:end]                                           # [q_len, heads, hd]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_len = end - start
        visible = torch.arange(kv_len)[None, :] <= (kv_len - q_len + torch.arange(q_len))[:, None]
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)
        start = end
    return out, None


def test_fused_paged_attention_equals_the_sdpa_path(runner):
    rng = random.Random(2)
    cached_history(runner, rng)
    batch = mixed_step(rng)
    sdpa = runner.execute(batch)
    runner.fused_attention = FusedPagedAttention(reference_fused_infer_attention_score, runner.num_heads,
                                                 runner.num_kv_heads, runner.head_dim, runner.block_size, runner.device)
    try:
        fused = runner.execute(batch)               # rewrites the same K/V, then attends through the kernel
    finally:
        runner.fused_attention = None
    assert fused.shape == sdpa.shape and (fused - sdpa).abs().max().item() < 1e-5


def test_fused_kernel_applies_only_on_npu_with_half_precision_and_16_multiple_blocks(monkeypatch):
    kernel = object()
    fake_torch_npu.install(monkeypatch, fake_torch_npu.FakeNpuRuntime([]), npu_fused_infer_attention_score=kernel)
    npu = types.SimpleNamespace(type="npu")        # torch.device("npu") exists only with the real torch_npu
    assert fused_attention_op(npu, torch.bfloat16, 128) is kernel
    assert fused_attention_op(npu, torch.float16, 16) is kernel
    assert fused_attention_op(npu, torch.float32, 128) is None
    assert fused_attention_op(npu, torch.bfloat16, 24) is None and fused_attention_op(npu, torch.bfloat16, 1024) is None
    assert fused_attention_op(torch.device("cpu"), torch.bfloat16, 128) is None
    rc = load_runtime_config(["+model=qwen3_tiny"])
    assert Qwen3Runner(rc.model, "cpu").fused_attention is None      # the CPU path is unchanged


def test_pages_hold_k_then_v_planes(runner):
    """The pool layout the fused kernel reads in place: page p's K rows at plane 2p, its V rows at 2p + 1."""
    runner.allocate_pools({"kv": 4}, 1)
    token, pos = 11, 5
    runner.execute(StepBatch([SeqStep("a", list(range(3, 3 + pos)) + [token], 0, {"kv": [2]})]))
    planes = runner.pools["kv"][0].view(-1, runner.block_size, runner.num_kv_heads * runner.head_dim)
    k, v = planes[4, pos], planes[5, pos]
    assert k.abs().sum() > 0 and v.abs().sum() > 0 and not torch.equal(k, v)
    assert planes[4, pos + 1:].abs().sum() == 0 and planes[[0, 1, 2, 3, 6, 7]].abs().sum() == 0
    w = runner.layers[0]
    x = F.rms_norm(F.embedding(torch.tensor([token]), runner.embed), (runner.hidden,), w.input_norm, runner.eps)
    kvh, hd = runner.num_kv_heads, runner.head_dim
    v_expected = F.linear(x, w.qkv)[0, -kvh * hd:]        # V takes no norm and no rope: compare it exactly
    assert torch.allclose(v, v_expected, atol=1e-6)
