"""The device half of every step on fake CUDA tensors (tests/support/fake_cuda.py): weights, pools and activations on
a fake `cuda` device, the host half (ModelRunner.prepare) real. A cross-device op, a host sync (`.tolist()`,
`.item()`, `bool(t)`, `.cpu()`, a data-dependent shape) or a `.view` that only the CPU's SDPA layout allows fails
here as it fails on a GPU, on a machine without one.

Covered, for both runners (Qwen3's decode rows both through the Triton paged kernel and through gather + SDPA):
prefill from position 0, decode rows of different contexts beside a chunk after cached
tokens, every worst step the startup profile runs, the sampler's device half at the profile's largest batch
(temperature, top-k, top-p), a constrained row's mask and the logprobs; for DeepSeek V4 also speculation's verify
step (MTP drafting inside the step). tests/npu/test_device_guard_mutants.py re-plants the two bugs a real GPU found
and checks that this file fails with each.
"""

from __future__ import annotations

import numpy
import pytest
import torch

from appliance.config.compose import load_runtime_config
from appliance.core.request import SamplingParams
from appliance.core.step_limits import step_limits, worst_steps
from npu.registry import build_runner
from npu.runner import ModelRunner
from npu.sampler import Sampler, apply_token_bitmask, logprob_tensors, worst_case_rows
from npu.step import SeqStep, StepBatch
from tests.support.fake_cuda import HostSyncError, fake_cuda, on_device

pytestmark = pytest.mark.usefixtures("one_torch_thread")

QWEN3 = ["+model=qwen3_tiny", "max_model_len=128", "max_num_seqs=4", "decode_batch=4"]
DSV4 = ["+model=dsv4_tiny", "max_model_len=128", "max_num_seqs=4", "decode_batch=4"]
DSV4_MTP = DSV4 + ["speculative.method=mtp", "speculative.num_tokens=2"]
# As released: FP8 linears and FP4 experts, read as stored by the Triton grouped GEMM (npu/grouped_gemm_triton.py).
DSV4_QUANTIZED = DSV4 + ["model.layout.quant_block_size=32", "model.layout.expert_dtype=fp4"]
BLOCKS = 24


QWEN3_GATHER = [*QWEN3, "model.name=gather"]    # Qwen3 whose decode rows take the gather + SDPA path, not Triton's


def fake_runner(overrides: list[str]) -> tuple[ModelRunner, object]:
    """The arch's runner on fake CUDA with its seeded random weights (made on the device) and pools of BLOCKS pages
    per group plus decode_batch scratch pages. QWEN3_GATHER: decode rows through gather + SDPA (where Triton is not
    installed), not the paged kernel."""
    rc = load_runtime_config(overrides)
    with fake_cuda(loading=True):
        runner = build_runner(rc.model, torch.device("cuda"))
        if overrides is QWEN3_GATHER:
            runner.paged_decode = None  # type: ignore[attr-defined]
        runner.load_weights()
        runner.allocate_pools({g.name: BLOCKS for g in rc.model.cache_groups}, rc.decode_batch)
    assert on_device(runner.pools[rc.model.cache_groups[0].name])
    return runner, rc


def step(runner: ModelRunner, batch: StepBatch) -> torch.Tensor:
    """prepare on the host (real), forward on fake CUDA."""
    inputs = runner.prepare(batch)
    with fake_cuda():
        logits = runner.forward(inputs)
    assert on_device(logits)
    return logits


def tables(runner: ModelRunner, first_page: int, tokens: int) -> dict[str, list[int]]:
    """Block tables of one sequence of `tokens` tokens whose pages start at first_page in every group (ring groups:
    their max_blocks_per_seq slots)."""
    out = {}
    for spec in runner.cache_specs:
        pages = spec.max_blocks_per_seq if spec.is_ring else -(-tokens // spec.tokens_per_page)
        out[spec.name] = [(first_page + j) % BLOCKS for j in range(pages)]
    return out


def serving_steps(runner: ModelRunner) -> list[StepBatch]:
    """Prefill from position 0 (two prompts), then a step with a chunk after cached tokens beside another prompt's
    second chunk, then decode rows of different contexts, twice. Chunks are at most 32 tokens and start on a
    16-token block (DeepSeek V4's tiny tokens_in_flight and ring rule)."""
    a, b = tables(runner, 0, 128), tables(runner, 10, 128)
    return [
        StepBatch([SeqStep("a", list(range(3, 35)), 0, a, sample=False, prompt_len=40),
                   SeqStep("b", list(range(5, 21)), 0, b, sample=False, prompt_len=32)]),
        StepBatch([SeqStep("a", list(range(35, 43)), 32, a, prompt_len=40),
                   SeqStep("b", list(range(21, 37)), 16, b, prompt_len=32)]),
        StepBatch([SeqStep("a", [7], 40, a), SeqStep("b", [11], 32, b)]),
        StepBatch([SeqStep("a", [9], 41, a), SeqStep("b", [12], 33, b)]),
    ]


@pytest.mark.parametrize("overrides", [QWEN3, QWEN3_GATHER, DSV4, DSV4_QUANTIZED],
                         ids=["qwen3", "qwen3_gather", "dsv4", "dsv4_fp8_fp4"])
def test_serving_steps_run_on_the_device_alone(overrides):
    runner, _ = fake_runner(overrides)
    if overrides is DSV4_QUANTIZED:      # the kernel's path: FP8 linears and FP4 expert stacks held as stored
        from npu.quant import QuantizedWeight
        assert runner.linears_as_stored  # type: ignore[attr-defined]
        stacks = runner.expert_stacks.values()  # type: ignore[attr-defined]
        assert stacks and all(isinstance(w, QuantizedWeight) for stack in stacks for w in stack)
    if overrides is QWEN3:               # the Triton kernels read the pages in place: decode rows and cached chunks
        from npu.paged_attention_triton import TritonDecodeAttention
        from npu.prefill_attention_triton import TritonPrefillAttention
        assert isinstance(runner.paged_decode, TritonDecodeAttention)  # type: ignore[attr-defined]
        assert isinstance(runner.cached_prefill, TritonPrefillAttention)  # type: ignore[attr-defined]
    if overrides in (DSV4, DSV4_QUANTIZED):   # attention's keys read in place by its Triton kernel
        assert runner.attention.in_place  # type: ignore[attr-defined]
    for batch in serving_steps(runner):
        logits = step(runner, batch)
        assert logits.shape[0] == sum(s.sample for s in batch.seqs)


@pytest.mark.parametrize("overrides", [QWEN3, QWEN3_GATHER, DSV4, DSV4_QUANTIZED],
                         ids=["qwen3", "qwen3_gather", "dsv4", "dsv4_fp8_fp4"])
def test_the_profiles_worst_steps_run_on_the_device_alone(overrides):
    runner, rc = fake_runner(overrides)
    names = []
    for shape in worst_steps(step_limits(rc)):
        step(runner, runner.scratch_batch(shape))
        names.append(shape.name)
    assert names


def test_speculations_verify_step_runs_on_the_device_alone():
    runner, _ = fake_runner(DSV4_MTP)
    a = tables(runner, 0, 128)
    step(runner, StepBatch([SeqStep("a", list(range(3, 35)), 0, a, sample=False, prompt_len=40)]))
    step(runner, StepBatch([SeqStep("a", list(range(35, 43)), 32, a, prompt_len=40)]))
    verify = StepBatch([SeqStep("a", [7], 40, a, num_draft=2)], draft_passes=2)
    logits = step(runner, verify)
    assert logits.shape[0] == 3 + 2          # every position's logits, then the drafter's of each draft
    step(runner, StepBatch([SeqStep("a", [8], 42, a, num_draft=2)], draft_passes=2))


def test_the_sampler_mask_and_logprobs_run_on_the_device_alone():
    vocab, rows = 512, 6
    with fake_cuda():
        logits = torch.randn(rows, vocab, device="cuda")
        sampler = Sampler(torch.device("cuda"))
    allowed = numpy.zeros((2, vocab // 32), dtype=numpy.int32)
    allowed[:, 0] = 0b1010
    params = worst_case_rows(rows - 2) + [("g0", SamplingParams()), ("g1", SamplingParams(logprobs=3))]
    host_ids = torch.tensor([1, 2, 3, 4, 5, 6])
    with fake_cuda():
        apply_token_bitmask(logits, [1, 4], torch.from_numpy(allowed))
        ids = sampler.draw(logits, params)
        chosen, ranks, top_lp, top_ids = logprob_tensors(logits, host_ids.to("cuda", non_blocking=True), 3)
    assert on_device(ids) and ids.shape == (rows,)
    assert on_device(top_ids) and top_ids.shape == (rows, 3)


def test_the_guard_refuses_the_device_bug_classes():
    """The guard itself: each class fails under it, and the same code runs on the CPU."""
    def sdpa_view():
        q = torch.randn(2, 4, 5, 16, device="cuda")
        torch.nn.functional.scaled_dot_product_attention(q, q, q).view(2, 4 * 5 * 16)

    def host_indexed_by_device_mask():
        ranked = torch.tensor([1, 2, 3])
        ranked[torch.randn(3, device="cuda") > 0]

    def host_sync():
        if torch.randn(3, device="cuda").any():
            pass

    for bug in (sdpa_view, host_indexed_by_device_mask, host_sync):
        with pytest.raises((HostSyncError, RuntimeError, ValueError)):
            with fake_cuda():
                bug()
