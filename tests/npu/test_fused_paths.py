"""Attention stays on the paths accelerators fuse, for both runners.

- SDPA gets a bool mask or is_causal, never an additive float mask (torch_npu keeps its fused kernel only
  for a bool mask or none). Recorded at the torch-function level: on CPU, torch's composite SDPA turns a
  bool mask into a float one before dispatch, so a dispatch mode would see float whatever the runner
  passed; an accelerator backend receives the mask as passed.
- Every index_select / index reads a contiguous tensor (recorded by a TorchDispatchMode, where the real
  source of each op is seen), so no step materializes a strided view of a pool layer.
- DeepSeek V4 attends with its own softmax (window rows, the indexer's picked compressed rows and a sink
  logit: no SDPA applies, see npu/deepseek_v4/attention.py): every mask it applies is a bool masked_fill, no
  -inf tensor is ever added to scores, and its pools are read and written one contiguous layer at a time.
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
from appliance.engine.kv_cache_manager import KvCacheManager
from npu.deepseek_v4.runner import DeepseekV4Runner
from npu.fused_attention import MASK_SIZE, FusedPagedAttention, fused_attention_op
from npu.qwen3.runner import Qwen3Runner
from npu.step import SeqStep, StepBatch
from tests.npu import fake_torch_npu
from tests.support.kv import blocks_per_group


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
    """For every index_select / index: whether its source is contiguous, and whether it reads pool storage;
    for every index_put_ into pool storage: the target's shape and whether it is contiguous."""

    def __init__(self, pools):
        super().__init__()
        self.pool_ptrs = {p.untyped_storage().data_ptr() for p in pools}
        self.reads: list[tuple[str, tuple[int, ...], bool, bool]] = []
        self.pool_writes: list[tuple[tuple[int, ...], bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.startswith(("index_select", "index.")):
            src = args[0]
            self.reads.append((func.__name__, tuple(src.shape), src.is_contiguous(),
                               src.untyped_storage().data_ptr() in self.pool_ptrs))
        elif func.__name__.startswith("index_put") and args[0].untyped_storage().data_ptr() in self.pool_ptrs:
            self.pool_writes.append((tuple(args[0].shape), args[0].is_contiguous()))
        return func(*args, **(kwargs or {}))


class MaskOps(TorchDispatchMode):
    """The mask dtype of every masked_fill, and every add / sub with a float operand holding -inf (an additive
    mask)."""

    def __init__(self):
        super().__init__()
        self.fill_masks: list[torch.dtype] = []
        self.additive: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if name.startswith("masked_fill"):
            self.fill_masks.append(args[1].dtype)
        elif name.split(".")[0] in ("add", "add_", "sub", "sub_"):
            if any(isinstance(a, torch.Tensor) and a.is_floating_point() and bool(torch.isneginf(a).any())
                   for a in args[:2]):
                self.additive.append(name)
        return func(*args, **(kwargs or {}))


def loaded(runner_class, model: str):
    """A runner of `model` on the CPU with its seeded random weights."""
    r = runner_class(load_runtime_config([f"+model={model}"]).model, "cpu")
    r.load_weights()
    return r


@pytest.fixture(scope="module")
def runner():
    """Decode rows on the SDPA path (what an accelerator without the fused kernel runs), not the CPU paged kernel."""
    r = loaded(Qwen3Runner, "qwen3_tiny")
    r.paged_decode = None
    return r


def cached_history(runner, rng):
    """Pages holding a 13-token and a 3-token history (prefilled alone), for steps that read cached tokens."""
    runner.allocate_pools({"kv": 64}, 2)
    histories = {"cached": ([rng.randrange(3, 500) for _ in range(13)], [0, 1, 2]),
                 "dec": ([rng.randrange(3, 500) for _ in range(3)], [3]),
                 "long": ([rng.randrange(3, 500) for _ in range(40)], [4, 5, 6])}
    for name, (tokens, pages) in histories.items():
        runner.execute(StepBatch([SeqStep(name, tokens, 0, {"kv": pages}, sample=False)], new_pages={"kv": pages}))
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
    return StepBatch(seqs, new_pages={"kv": list(range(10, page))})     # first used here


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
    runner.execute(StepBatch([], new_pages={"kv": [0, 1, 2, 3]}))     # each page zeroed, as when first used
    token, pos = 11, 5
    runner.execute(StepBatch([SeqStep("a", list(range(3, 3 + pos)) + [token], 0, {"kv": [2]})]))
    planes = runner.pools["kv"][0].view(-1, runner.block_size, runner.num_kv_heads * runner.head_dim)
    k, v = planes[4, pos], planes[5, pos]
    assert k.abs().sum() > 0 and v.abs().sum() > 0 and not torch.equal(k, v)
    assert planes[4, pos + 1:].abs().sum() == 0 and planes[[0, 1, 2, 3, 6, 7]].abs().sum() == 0
    w = runner.layers[0]
    x = F.rms_norm(F.embedding(torch.tensor([token]), runner.embed), (runner.hidden,), w.input_norm, runner.eps)
    kvh, hd = runner.num_kv_heads, runner.head_dim
    v_expected = w.qkv(x)[0, -kvh * hd:]        # V takes no norm and no rope: compare it exactly
    assert torch.allclose(v, v_expected, atol=1e-6)


@pytest.fixture(scope="module")
def dsv4():
    return loaded(DeepseekV4Runner, "dsv4_tiny")


def dsv4_mixed_step(runner, rng) -> StepBatch:
    """Histories prefilled first on pages a KvCacheManager hands out, then one step with every attention path:
    decode rows at different contexts (window only, HCA and CSA rows visible), a chunk after cached tokens,
    and chunks from position 0 of two lengths."""
    model, tif = runner.model, runner.model.layout.tokens_in_flight
    kv = KvCacheManager(model.cache_groups, model.layout.block_size, enable_prefix_caching=False)
    kv.initialize(blocks_per_group(kv.specs, 8 * model.cache_groups[0].max_blocks_per_seq))
    runner.allocate_pools({s.name: 8 * s.max_blocks_per_seq for s in model.cache_groups}, 1)
    tokens = {rid: [rng.randrange(3, 500) for _ in range(n)] for rid, n in
              [("d9", 10), ("d70", 71), ("d200", 201), ("cached", 96), ("f32", 32), ("f32b", 32), ("f5", 5)]}
    history = {"d9": 9, "d70": 70, "d200": 200, "cached": 64}
    for rid, done in history.items():
        for start in range(0, done, tif):
            n = min(tif, done - start)
            kv.allocate(rid, tokens[rid], n)
            runner.execute(StepBatch([SeqStep(rid, tokens[rid][start:start + n], start, kv.block_tables(rid), False)],
                                     new_pages=kv.take_new_pages()))
            kv.commit(rid, start + n)
    seqs = []
    for rid, ids in tokens.items():
        start = history.get(rid, 0)
        kv.allocate(rid, ids, len(ids) - start)
        seqs.append(SeqStep(rid, ids[start:], start, kv.block_tables(rid)))
    return StepBatch(seqs, new_pages=kv.take_new_pages())


def test_dsv4_masks_are_bool_and_pools_are_read_and_written_one_layer_at_a_time(dsv4):
    batch = dsv4_mixed_step(dsv4, random.Random(4))
    masks, sdpa, sources = MaskOps(), SdpaMasks(), IndexSources(dsv4.pools.values())
    with sdpa, masks, sources:
        logits = dsv4.execute(batch)
    assert logits.shape == (len(batch.seqs), dsv4.model.layout.vocab_size) and torch.isfinite(logits).all()
    assert all(dtype in (None, torch.bool) for dtype, _ in sdpa.calls), sdpa.calls
    assert masks.fill_masks and set(masks.fill_masks) == {torch.bool} and not masks.additive, masks.additive
    assert sources.reads and all(contiguous for _, _, contiguous, _ in sources.reads), sources.reads
    layer_planes = {tuple(p.shape[1:]) for p in dsv4.pools.values()}
    pool_reads = [shape for _, shape, _, in_pool in sources.reads if in_pool]
    layers, groups = len(dsv4.ratios), 3                     # query lengths: 1 (decodes), 5, 32 (chunks and cached)
    assert len(pool_reads) >= layers * 3 and all(shape in layer_planes for shape in pool_reads)   # one layer each
    assert sources.pool_writes and all(contiguous and shape in layer_planes for shape, contiguous in sources.pool_writes)
    ori_reads = [shape for shape in pool_reads if shape == tuple(dsv4.pools["ori"].shape[1:])]
    assert len(ori_reads) == layers * groups                # the window rows: once per layer per query group
