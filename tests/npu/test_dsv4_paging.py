"""DeepseekV4Runner's pool reads and writes with rows stored in another dtype than the activations (written
against the mutation run's survivors, docs/TESTING.md): the validator allows any float row dtype, so rows are
cast on the way into the pool and back to the compute dtype on the way out, and the logits stay within the
row dtype's rounding of float32 rows'. And where rows are located: a row without a page is refused, never
read from a padding entry or a wrapped slot of a full group; int8 rows keep small values."""

import dataclasses
import random

import pytest
import torch

from appliance.config.compose import load_runtime_config
from appliance.core.errors import ConfigError
from npu.deepseek_v4.paging import PoolIO, Rows, build_plan
from npu.deepseek_v4.runner import DeepseekV4Runner
from npu.step import SeqStep, StepBatch
from tests.npu.test_fused_paths import dsv4_mixed_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def mixed_step_logits(model) -> torch.Tensor:
    """Histories prefilled first, then one step with every attention path (test_fused_paths.dsv4_mixed_step)."""
    runner = DeepseekV4Runner(model, "cpu")
    runner.load_weights()                     # the seeded random weights: the same for every runner of the model
    return runner.execute(dsv4_mixed_step(runner, random.Random(4)))


def test_float_rows_stored_as_bfloat16_serve_within_its_rounding():
    model = load_runtime_config(["+model=dsv4_tiny"]).model
    assert model.layout.dtype == "float32"
    half = dataclasses.replace(model, cache_groups=tuple(
        dataclasses.replace(s, row_dtype="bfloat16") if s.row_dtype == "float32" else s for s in model.cache_groups))
    assert {s.row_dtype for s in half.cache_groups} == {"bfloat16"}       # windows, compressed rows and states
    reference, logits = mixed_step_logits(model), mixed_step_logits(half)
    assert logits.dtype == torch.float32 and logits.shape == reference.shape
    diff = (logits - reference).abs().max().item()
    assert 0 < diff < 0.01 * reference.abs().max().item(), diff             # rounded, not lost


def plan_of(seqs: list[SeqStep]):
    model = load_runtime_config(["+model=dsv4_tiny"]).model
    runner = DeepseekV4Runner(model, "cpu")          # no weights, no pools: its kinds of compression only
    return build_plan(model, StepBatch(seqs), list(runner.kinds.values()), runner.device)


def tables(pages: dict[str, int]) -> dict[str, list[int]]:
    """Block tables of dsv4_tiny: every ring full, `pages[name]` pages of each full group (ids do not matter to
    the plan, which only locates rows)."""
    model = load_runtime_config(["+model=dsv4_tiny"]).model
    return {s.name: list(range(s.max_blocks_per_seq if s.is_ring else pages[s.name])) for s in model.cache_groups}


def test_a_row_without_a_page_is_a_clear_error_next_to_longer_tables():
    """Compressed row 10 of cmp_c4 (4 rows a page) is on logical page 2: a block table of 2 pages, or none, is
    refused with the request and the row, also when another sequence's table of that group is longer."""
    full = {"cmp_c16": 3, "cmp_c4": 3, "idx": 3}
    other = SeqStep("other", list(range(3, 35)), 0, tables(full))
    short = tables(full)
    short["cmp_c4"] = short["cmp_c4"][:2]
    missing = tables(full)
    del missing["cmp_c4"]
    for table, row in ((short, 8), (missing, 0)):
        with pytest.raises(ValueError, match=rf"^request 'd': cache group 'cmp_c4' has no page for row {row} "):
            plan_of([SeqStep("d", [5], 40, table), other])


def test_a_full_group_never_wraps_past_its_table():
    """Position 515 completes cmp_c4 row 128, on logical page 32 of a 32-page table: refused (a ring would
    reuse slot 0; a full group must not overwrite the sequence's first compressed rows)."""
    model = load_runtime_config(["+model=dsv4_tiny", "max_model_len=512"]).model
    pages = {s.name: s.max_blocks_per_seq for s in model.cache_groups}
    assert pages["cmp_c4"] == 32 and model.group("cmp_c4").rows_per_block == 4
    with pytest.raises(ValueError, match=r"cache group 'cmp_c4' has no page for row 128 \(logical page 32"):
        plan_of([SeqStep("d", [5], 515, tables(pages))])


def quantized_idx_pool(row_dtype: str):
    """dsv4_tiny's idx group with quantized rows (row_dtype + a 4 B fp32 scale), a 2-page pool of it and its PoolIO."""
    model = load_runtime_config(["+model=dsv4_tiny"]).model
    spec = dataclasses.replace(model.group("idx"), row_dtype=row_dtype, row_extra_bytes=4)
    model = dataclasses.replace(model, cache_groups=tuple(spec if s.name == "idx" else s for s in model.cache_groups))
    pool = torch.zeros(spec.num_layers, 2, spec.rows_per_block, spec.row_width + 4, dtype=getattr(torch, row_dtype))
    return spec, pool, PoolIO(model, {"idx": pool})


def test_int8_rows_keep_small_values_to_half_a_step():
    """Rows of absolute maximum 0.05 quantize with their own scale (0.05 / 127), not a floor of 1 / 127."""
    spec, pool, io = quantized_idx_pool("int8")
    width = spec.row_width
    values = torch.linspace(-0.05, 0.04, 2 * width).view(2, width)
    rows = Rows(torch.tensor([1, 0]), torch.tensor([3, 1]), torch.tensor([True, True]))
    layer = spec.layer_ids[0]
    io.write("idx", layer, rows, values)
    back = io.read("idx", layer, rows, width, torch.float32)
    step = values.abs().amax(-1, keepdim=True) / 127
    assert ((back - values).abs() <= 0.5 * step + 1e-7).all()
    assert pool[:, 1, 3].any() and pool[:, 0, 1].any() and not pool[:, 1, :3].any()


def test_float8_rows_hold_e4m3_values_and_their_row_scale():
    """float8_e4m3fn rows (dsv4.yaml's idx): 128 B + 4 B as vLLM stores DeepSeek's indexer keys. Each row's
    largest magnitude maps to e4m3's largest finite value, 448, through the fp32 scale stored after the row; every
    value comes back within e4m3's half step (3 mantissa bits: 2^-4 relative, 2^-10 of 448 x scale for
    subnormals)."""
    spec, pool, io = quantized_idx_pool("float8_e4m3fn")
    width = spec.row_width
    values = torch.randn(2, width, generator=torch.Generator().manual_seed(0)) * torch.tensor([[0.03], [7.0]])
    rows = Rows(torch.tensor([1, 0]), torch.tensor([2, 0]), torch.tensor([True, True]))
    layer = spec.layer_ids[1]
    io.write("idx", layer, rows, values)
    stored = pool[spec.layer_ids.index(layer), rows.page, rows.row]
    scale = stored[:, width:].contiguous().view(torch.int8).view(torch.float32)
    amax = values.abs().amax(-1, keepdim=True)
    assert torch.allclose(scale, amax / 448, rtol=1e-6)
    assert torch.allclose(stored[:, :width].float().abs().amax(-1, keepdim=True), torch.full_like(amax, 448.0))
    back = io.read("idx", layer, rows, width, torch.float32)
    assert ((back - values).abs() <= torch.maximum(values.abs() * 2 ** -4, scale * 2 ** -10) + 1e-7).all()
    assert not pool[:, 1, :2].float().any() and not pool[:, 0, 1:].float().any()       # other rows untouched


@pytest.mark.parametrize("row, message", [
    ({"dtype": "float8_e4m3fn", "extra_bytes": 0}, "float8_e4m3fn rows of group 'idx' need 4 extra bytes"),
    ({"dtype": "uint8", "extra_bytes": 4}, "1-byte rows are int8 or float8_e4m3fn"),
    ({"dtype": "int32", "extra_bytes": 0}, "rows are floating, or int8 / float8_e4m3fn"),
])
def test_idx_row_formats_the_runner_cannot_store_are_config_errors(row, message):
    overrides = [f"model.cache_groups.3.row.{k}={v}" for k, v in row.items()]
    with pytest.raises(ConfigError, match="model.cache_groups\\[3\\]") as info:
        load_runtime_config(["+model=dsv4_tiny", *overrides])
    assert message in str(info.value)


def test_a_plan_reaches_the_device_in_one_copy_per_dtype():
    """StepPlan.to packs the plan's host tensors into one buffer per dtype: every tensor arrives with its values,
    shape and dtype, in its place, and a step's plan (masks, page and row tables, index plans) costs two uploads."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tests.support.fake_cuda import fake_cuda, on_device
    runner = DeepseekV4Runner(load_runtime_config(["+model=dsv4_tiny"]).model, "cpu")
    runner.load_weights()                     # dsv4_mixed_step prefills the histories first
    host = build_plan(runner.model, dsv4_mixed_step(runner, random.Random(4)), list(runner.kinds.values()),
                      torch.device("cpu"))
    before: list[torch.Tensor] = []
    host.map(lambda t: before.append(t) or t)
    assert len(before) > 20 and {t.dtype for t in before} == {torch.int64, torch.bool}
    after: list[torch.Tensor] = []
    host.to(torch.device("cpu")).map(lambda t: after.append(t) or t)       # the same packing, onto the host
    assert len(after) == len(before)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(after, before))

    class Uploads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and on_device(out) and not on_device(args[0]):
                Uploads.count += 1
            return out
    with fake_cuda(), Uploads():
        on_gpu = host.to(torch.device("cuda"))
    assert Uploads.count == 2
    assert on_device(on_gpu.token_ids) and all(on_device(g.window_mask) for g in on_gpu.groups)
    on_gpu.map(lambda t: after.append(t) or t)
    assert all(t.storage_offset() * t.element_size() % 16 == 0 for t in after[len(before):])  # aligned starts
