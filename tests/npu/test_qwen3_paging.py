"""Qwen3Runner's paged indexing where the transformers oracle cannot see it (written against the mutation run's
survivors, docs/TESTING.md): the device every step tensor lives on, the pool dtype differing from the model's,
the gather buffer, and the decode-bucket rule at its exact boundaries.

- Another device: the oracle runs on the CPU, where a tensor built without a device lands anyway. Here the
  runner runs on torch's "meta" device (shapes only, no data), where any index, offset or buffer left on the
  host makes the step fail with a cross-device error, on both attention paths.
- A pool of another float dtype than the activations (the validator allows any float row dtype): rows read
  from the pool are cast back, and the logits stay within the pool dtype's rounding of a float32 pool's.
"""

import dataclasses
import random
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import npu.qwen3.step_meta
from appliance.config.compose import load_runtime_config
from npu.fused_attention import FusedPagedAttention
from npu.qwen3.runner import Qwen3Runner
from npu.qwen3.step_layout import SPLIT_MIN_SAVING, decode_buckets
from npu.step import SeqStep, StepBatch
from tests.npu.test_fused_paths import SdpaMasks

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def model(row_dtype: str | None = None):
    m = load_runtime_config(["+model=qwen3_tiny"]).model
    if row_dtype is None:
        return m
    return dataclasses.replace(m, cache_groups=(dataclasses.replace(m.cache_groups[0], row_dtype=row_dtype),))


def runner_on(device: str, row_dtype: str | None = None) -> Qwen3Runner:
    """A runner on the gather + SDPA path for decode rows (this file checks it), also on the CPU, where decode
    rows otherwise go to the paged kernel (tests/npu/test_paged_attention_cpu.py checks that one)."""
    r = Qwen3Runner(model(row_dtype), device)
    r.paged_decode = None
    r.load_weights()                  # the seeded random weights: the same for every runner of the model
    return r


def histories(rng: random.Random) -> dict[str, tuple[list[int], list[int]]]:
    """Prompts and their pages: contexts of 3, 13 and 40 tokens (16-token pages), prefilled alone first."""
    return {"dec": ([rng.randrange(3, 500) for _ in range(3)], [3]),
            "cached": ([rng.randrange(3, 500) for _ in range(13)], [0, 1, 2]),
            "long": ([rng.randrange(3, 500) for _ in range(40)], [4, 5, 6])}


def mixed_step(rng: random.Random) -> StepBatch:
    """Decode rows of different contexts, a chunk after cached tokens and chunks from position 0."""
    return StepBatch([SeqStep("dec", [7], 3, {"kv": [3]}), SeqStep("long", [9], 40, {"kv": [4, 5, 6]}),
                      SeqStep("cached", [rng.randrange(3, 500) for _ in range(8)], 13, {"kv": [0, 1, 2]}),
                      SeqStep("f0", [rng.randrange(3, 500) for _ in range(16)], 0, {"kv": [10]}),
                      SeqStep("f1", [rng.randrange(3, 500) for _ in range(7)], 0, {"kv": [11]}, sample=False)],
                     new_pages={"kv": [10, 11]})     # first used here (the pool starts uninitialized)


def run_mixed(runner: Qwen3Runner, seed: int = 3) -> torch.Tensor:
    rng = random.Random(seed)
    runner.allocate_pools({"kv": 16}, 1)
    for name, (tokens, pages) in histories(rng).items():
        runner.execute(StepBatch([SeqStep(name, tokens, 0, {"kv": pages}, sample=False)], new_pages={"kv": pages}))
    return runner.execute(mixed_step(rng))


def kernel_on_query_device(query, key, value, *, atten_mask, block_table, **kwargs):
    """A stand-in for the fused kernel that only checks where its tensors are (meta tensors hold no data)."""
    assert {t.device for t in (key, value, atten_mask, block_table)} == {query.device}
    assert block_table.dtype == torch.int32
    return torch.empty_like(query), None


def test_a_runner_on_another_device_keeps_every_step_tensor_there():
    runner = runner_on("meta")
    logits = run_mixed(runner)                                        # the SDPA path: gathers and masks
    assert logits.device.type == "meta" and logits.shape == (4, runner.model.layout.vocab_size)
    runner.fused_attention = FusedPagedAttention(kernel_on_query_device, runner.num_heads, runner.num_kv_heads,
                                                 runner.head_dim, runner.block_size, runner.device)
    logits = run_mixed(runner)                                        # the fused path: its block table
    assert logits.device.type == "meta" and logits.shape == (4, runner.model.layout.vocab_size)


def test_a_pool_in_another_float_dtype_serves_within_its_rounding():
    reference = run_mixed(runner_on("cpu"))
    for row_dtype in ("bfloat16", "float16"):
        runner = runner_on("cpu", row_dtype)
        logits = run_mixed(runner)
        assert runner.pools["kv"].dtype == getattr(torch, row_dtype) and logits.dtype == torch.float32
        diff = (logits - reference).abs().max().item()
        assert diff < 0.01 * reference.abs().max().item(), (row_dtype, diff)


def is_pool(t: torch.Tensor, pool: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()


class PoolGathers(TorchDispatchMode):
    """For each index_select reading the runner's pool: how many planes it copies, and the storage it writes
    into (None: a fresh tensor, no `out`)."""

    def __init__(self, runner: Qwen3Runner):
        super().__init__()
        self.runner = runner              # its pool is reallocated by each run_mixed: looked up at each op
        self.outs: list[int | None] = []
        self.planes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.__name__.startswith("index_select") and is_pool(args[0], self.runner.pools["kv"]):
            out = kwargs.get("out")
            self.outs.append(None if out is None else out.untyped_storage().data_ptr())
            self.planes.append(args[2].numel())
        return func(*args, **kwargs)


def test_gathers_copy_into_one_buffer_reused_across_layers_and_steps():
    """The decode and cached-chunk gathers of every layer, over two steps of the same shapes, all write into
    one buffer: no multi-MB tensor is allocated per layer (npu/qwen3/runner.py's Qwen3Runner._gather says why)."""
    runner = runner_on("cpu")
    run_mixed(runner, seed=4)
    gathers = PoolGathers(runner)
    with gathers:
        run_mixed(runner, seed=4)
    layers = runner.model.layout.num_layers
    assert len(gathers.outs) >= 2 * layers                # one for the decode bucket, one for the cached chunk
    assert None not in gathers.outs and len(set(gathers.outs)) == 1, gathers.outs


def test_decode_buckets_split_exactly_at_half_width_and_the_minimum_saving():
    """The rule at its boundaries: a row of exactly half the bucket's width starts a new bucket when the
    padding saved, (width - its width) x rows left x block_size, is exactly SPLIT_MIN_SAVING, not one less."""
    block = 16
    rows = SPLIT_MIN_SAVING // (4 * block)                 # rows of width 4 under one of width 8: saving exact
    assert decode_buckets([8] + [4] * rows, block) == [(0, 1), (1, 1 + rows)]
    assert decode_buckets([8] + [4] * (rows - 1), block) == [(0, rows)]            # one row short of paying
    assert decode_buckets([8] + [5] * 2 * rows, block) == [(0, 1 + 2 * rows)]      # 5 > 8 / 2: never split
    assert decode_buckets([9] + [4] * rows, block) == [(0, 1), (1, 1 + rows)]      # under half: split


@pytest.mark.parametrize("widths, buckets", [
    ((1, 65), ((1, 65), (1, 1))),        # batch order narrow first: sorted by width, (2 - 1) x 64 x 16 = 1024 saved
    ((65, 130), ((1, 130), (1, 65))),    # exactly half the widest: split
    ((65, 40), ((2, 65),)),              # 40 > 65 / 2: one bucket padded to 65 pages
])
def test_decode_rows_are_gathered_once_per_bucket(widths, buckets):
    """Each decode bucket (rows, width in pages) is one gather per layer of 2 x rows x width planes (K and V),
    whatever the batch order, and the logits come back in batch order, each row's equal to its step alone. A
    chunk after cached tokens follows in the same step (its 2 pages are gathered after the buckets' pages).
    Contexts end on the last token of their pages; the pool holds zeros but each row's own K/V."""
    runner = runner_on("cpu")
    runner.allocate_pools({"kv": sum(widths) + 2}, 1)
    runner.execute(StepBatch([], new_pages={"kv": list(range(sum(widths) + 2))}))   # zeroed, as first used
    block, first = runner.block_size, 2
    chunk = SeqStep("chunk", list(range(3, 11)), block, {"kv": [0, 1]})
    decodes = []
    for i, width in enumerate(widths):
        decodes.append(SeqStep(f"r{i}", [5 + i], width * block - 1, {"kv": list(range(first, first + width))}))
        first += width
    layers = runner.model.layout.num_layers
    for seqs in ([chunk, *decodes], decodes):        # with the chunk, and decode rows alone (every row sampled)
        gathers = PoolGathers(runner)
        with gathers:
            together = runner.execute(StepBatch(seqs))
        expected = Counter({2 * rows * width: layers for rows, width in buckets})
        expected[2 * 2] += layers if chunk in seqs else 0
        assert +Counter(gathers.planes) == +expected
        alone = torch.cat([runner.execute(StepBatch([s])) for s in seqs])
        assert (together - alone).abs().max().item() < 1e-5


def test_chunks_from_position_0_of_equal_length_share_one_causal_call():
    """Chunks of 16, 7 and 16 tokens from position 0 (a cached chunk between them in batch order): one causal
    attention call per layer for each length, one masked call for the cached chunk."""
    runner = runner_on("cpu")
    runner.allocate_pools({"kv": 8}, 1)
    runner.execute(StepBatch([SeqStep("cached", list(range(3, 16)), 0, {"kv": [0]}, sample=False)]))
    steps = [SeqStep("a", list(range(3, 19)), 0, {"kv": [1]}), SeqStep("cached", [5, 6], 13, {"kv": [0]}),
             SeqStep("b", list(range(3, 10)), 0, {"kv": [2]}), SeqStep("c", list(range(4, 20)), 0, {"kv": [3]})]
    masks = SdpaMasks()
    with masks:
        runner.execute(StepBatch(steps))
    layers = runner.model.layout.num_layers
    assert sum(causal for _, causal in masks.calls) == 2 * layers
    assert sum(dtype is torch.bool for dtype, _ in masks.calls) == layers


@pytest.mark.parametrize("cap, groups", [(None, {3: 1}), (64, {2: 1, 1: 1})])
def test_cached_chunks_of_the_same_start_and_length_share_one_gather_and_call(cap, groups, monkeypatch):
    """Three prompts' second 16-token chunks (start 16, batch order mixed with a 9-token one of another start):
    one gather of all three chunks' pages and one masked call per layer, or with GROUP_GATHER_TOKENS at 64 (two
    32-token contexts) the first two together and the third alone; each row's logits equal to its chunk run
    alone (so each chunk attends to its own pages, not a neighbour's)."""
    if cap is not None:
        monkeypatch.setattr(npu.qwen3.step_meta, "GROUP_GATHER_TOKENS", cap)
    runner = runner_on("cpu")
    runner.allocate_pools({"kv": 12}, 1)
    rng = random.Random(8)
    prompts = {name: [rng.randrange(3, 500) for _ in range(32)] for name in "abcd"}
    tables = {"a": [0, 1], "b": [2, 3], "c": [4, 5], "d": [6, 7]}
    for name, tokens in prompts.items():
        runner.execute(StepBatch([SeqStep(name, tokens[:16], 0, {"kv": tables[name]}, sample=False)]))
    runner.execute(StepBatch([SeqStep("d", prompts["d"][16:23], 16, {"kv": tables["d"]}, sample=False)]))
    seqs = [SeqStep("a", prompts["a"][16:], 16, {"kv": tables["a"]}), SeqStep("d", prompts["d"][23:], 23, {"kv": tables["d"]}),
            SeqStep("b", prompts["b"][16:], 16, {"kv": tables["b"]}), SeqStep("c", prompts["c"][16:], 16, {"kv": tables["c"]})]
    gathers, masks = PoolGathers(runner), SdpaMasks()
    with gathers, masks:
        together = runner.execute(StepBatch(seqs))
    layers = runner.model.layout.num_layers
    expected = Counter()
    for chunks, count in groups.items():                 # chunks per group: 2 pages each, K and V planes
        expected[2 * chunks * 2] += count * layers
    expected[2 * 2] += layers                             # d
    assert Counter(gathers.planes) == expected
    assert sum(dtype is torch.bool for dtype, _ in masks.calls) == (sum(groups.values()) + 1) * layers
    alone = torch.cat([runner.execute(StepBatch([s])) for s in seqs])
    assert (together - alone).abs().max().item() < 1e-5


def test_a_chunk_after_one_cached_token_equals_the_prompt_at_once():
    """The smallest cached context: token 0 alone, then tokens 1.. as one chunk, which must attend to token 0."""
    runner = runner_on("cpu")
    runner.allocate_pools({"kv": 2}, 1)
    prompt = [17, 4, 250, 9, 33, 101]
    at_once = runner.execute(StepBatch([SeqStep("a", prompt, 0, {"kv": [0]})]))
    runner.execute(StepBatch([SeqStep("b", prompt[:1], 0, {"kv": [1]}, sample=False)]))
    chunked = runner.execute(StepBatch([SeqStep("b", prompt[1:], 1, {"kv": [1]})]))
    assert (chunked - at_once).abs().max().item() < 1e-5


def test_a_step_without_tokens_or_without_a_block_table_is_a_clear_error():
    runner = runner_on("cpu")
    runner.allocate_pools({"kv": 4}, 1)
    with pytest.raises(ValueError, match=r"^request e: a step needs at least one token$"):
        runner.execute(StepBatch([SeqStep("e", [], 0, {"kv": [0]})]))
    with pytest.raises(ValueError, match=r"^request t: block table 'kv' covers 0 tokens, the step needs 3$"):
        runner.execute(StepBatch([SeqStep("t", [1, 2, 3], 0, {})]))
