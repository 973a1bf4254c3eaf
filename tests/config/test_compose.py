"""Config composition and validation: reference figures, every rule with its key path, CLI behaviour."""

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from appliance.config.compose import compose, load_runtime_config
from appliance.core.errors import ConfigError
from appliance.core.kv_cache_spec import DTYPE_BYTES, bytes_per_slot

# DESIGN.md section 4: page bytes and max blocks per sequence at max_model_len 8,192.
DSV4_REFERENCE = {
    "ori": (43, 128, 5_636_096, 4),
    "cmp_c128": (20, 1, 20_480, 64),
    "cmp_c4": (21, 32, 688_128, 64),
    "idx": (21, 32, 88_704, 64),
    "hca_state": (20, 8, 655_360, 48),
    "csa_state": (21, 4, 688_128, 65),
    "csa_inner_state": (21, 4, 172_032, 65),
}


def issues_of(overrides):
    with pytest.raises(ConfigError) as info:
        load_runtime_config(overrides)
    return info.value.issues


def assert_issue(overrides, path, words):
    issues = issues_of(overrides)
    matching = [i for i in issues if i.path == path]
    assert matching, f"no issue at {path}; got {[str(i) for i in issues]}"
    assert any(all(w in str(i) for w in words) for i in matching), [str(i) for i in matching]


def test_dsv4_groups_match_reference_table():
    rc = load_runtime_config(["+model=dsv4", "max_model_len=8192"])
    got = {g.name: (g.num_layers, g.rows_per_block, g.page_size_bytes, g.max_blocks_per_seq)
           for g in rc.model.cache_groups}
    assert got == DSV4_REFERENCE
    assert [g.name for g in rc.model.cache_groups] == list(DSV4_REFERENCE)


def test_dsv4_layout_counts():
    rc = load_runtime_config(["+model=dsv4"])
    ratios = rc.model.main_layer_ratios
    assert len(ratios) == 43 and rc.model.layout.compress_ratios[-1] == 0
    assert ratios.count(4) == 21 and ratios.count(128) == 20 and ratios.count(0) == 2


@pytest.mark.parametrize("max_model_len,slot_bytes", [(512, 113_101_312), (8192, 160_940_032), (16384, 211_968_000)])
def test_slot_bytes_reference(max_model_len, slot_bytes):
    rc = load_runtime_config(["+model=dsv4", f"max_model_len={max_model_len}"])
    assert bytes_per_slot(rc.model.cache_groups) == slot_bytes


def test_default_model_is_dsv4_tiny_with_all_seven_groups():
    rc = load_runtime_config([])
    assert rc.model.name == "deepseek-v4-tiny" and rc.model.arch == "deepseek_v4"
    assert len(rc.model.cache_groups) == 7
    assert rc.block_size == 16 and rc.model.layout.sliding_window == 16
    assert sorted(set(rc.model.main_layer_ratios) - {0}) == [4, 16]
    assert rc.npu_memory_utilization == 0.90
    assert rc.server.host == "127.0.0.1" and rc.server.port == 50051


def test_plus_model_and_override_compose_exactly_as_written():
    rc = load_runtime_config(["+model=dsv4", "npu_memory_utilization=0.85"])
    assert rc.model.name == "deepseek-v4-flash" and rc.npu_memory_utilization == 0.85


def test_qwen3_has_one_ordinary_group():
    for name in ("qwen3", "qwen3_tiny"):
        rc = load_runtime_config([f"+model={name}", "max_model_len=1024"])
        (group,) = rc.model.cache_groups
        lay = rc.model.layout
        assert group.history == "full" and group.num_layers == lay.num_layers
        assert group.row_width == 2 * lay.num_kv_heads * lay.head_dim
        assert group.max_blocks_per_seq == 1024 // lay.block_size


def test_runtime_config_is_frozen():
    from dataclasses import FrozenInstanceError
    rc = load_runtime_config([])
    with pytest.raises(FrozenInstanceError, match="decode_batch"):
        rc.decode_batch = 3
    with pytest.raises(FrozenInstanceError, match="hidden_size"):
        rc.model.layout.hidden_size = 3


def test_dtype_table_matches_torch():
    torch = pytest.importorskip("torch")
    for name, size in DTYPE_BYTES.items():
        dtype = getattr(torch, name)
        assert isinstance(dtype, torch.dtype) and dtype.itemsize == size, name


@pytest.mark.parametrize("value", [0, -0.1, 1.01])
def test_utilization_range(value):
    assert_issue([f"npu_memory_utilization={value}"], "npu_memory_utilization", ["(0, 1]", str(value)])


@pytest.mark.parametrize("key", ["decode_batch", "max_model_len", "max_num_seqs", "max_num_batched_tokens"])
def test_non_positive_sizes(key):
    assert_issue([f"{key}=0"], key, ["positive integer"])


def test_non_positive_group_sizes_name_the_full_path():
    assert_issue(["+model=dsv4", "model.cache_groups.2.rows_per_block=0"], "model.cache_groups[2].rows_per_block",
                 ["positive integer", "0"])
    assert_issue(["+model=dsv4_tiny", "model.layout.hidden_size=-4"], "model.layout.hidden_size", ["positive integer", "-4"])


def test_non_integer_size_is_rejected_by_the_schema():
    with pytest.raises(ConfigCompositionException, match="decode_batch=1.5") as info:
        compose(["decode_batch=1.5"])
    assert isinstance(info.value.__cause__, ValidationError)


def test_unknown_keys_are_errors():
    with pytest.raises(ConfigError, match="model.layout.hiden_size = 3: .*did you mean model.layout.hidden_size"):
        compose(["+model=dsv4", "model.layout.hiden_size=3"])


def test_layers_that_do_not_exist():
    assert_issue(["+model=dsv4", "model.cache_groups.0.layers=[0,43]"], "model.cache_groups[0].layers",
                 ["[0, 43)", "43"])


def test_compress_ratio_the_layout_lacks():
    assert_issue(["+model=dsv4", "model.cache_groups.2.layers={compress_ratio:8}"],
                 "model.cache_groups[2].layers.compress_ratio", ["8", "no main layer"])


def test_block_size_not_divisible_by_ratio():
    assert_issue(["+model=dsv4", "model.layout.block_size=96"], "model.layout.compress_ratios[3]",
                 ["128", "divide", "96"])
    assert_issue(["+model=dsv4", "model.cache_groups.2.tokens_per_row=3"], "model.cache_groups[2].tokens_per_row",
                 ["3", "divide", "128"])


def test_full_history_page_must_cover_a_block():
    assert_issue(["+model=dsv4", "model.cache_groups.2.rows_per_block=16"], "model.cache_groups[2].rows_per_block",
                 ["16", "block_size"])


def test_max_model_len_above_cap():
    assert_issue(["+model=dsv4", "max_model_len=16385"], "max_model_len", ["16385", "16384"])
    load_runtime_config(["+model=dsv4", "max_model_len=16384"])


def test_decode_batch_and_max_num_seqs_above_layout_limits():
    assert_issue(["decode_batch=257"], "decode_batch", ["257", "max_decode_batch"])
    assert_issue(["max_num_seqs=100000"], "max_num_seqs", ["100000", "model.max_num_seqs"])


def test_unknown_dtype():
    assert_issue(["+model=dsv4", "model.cache_groups.3.row.dtype=int7"], "model.cache_groups[3].row.dtype",
                 ["int7", "torch dtype"])
    assert_issue(["+model=qwen3_tiny", "model.layout.dtype=bf17"], "model.layout.dtype", ["bf17"])


def test_duplicate_group_names():
    assert_issue(["+model=dsv4", "model.cache_groups.1.name=ori"], "model.cache_groups[1].name", ["ori", "duplicate"])


def test_tiny_full_mixup_compress_ratio_length():
    # The tiny model's ratios on the full layout: 6 entries for 43 + 1 layers.
    assert_issue(["+model=dsv4", "model.layout.compress_ratios=[0,4,16,4,16,0]"], "model.layout.compress_ratios",
                 ["44 entries", "has 6"])


def test_several_errors_reported_together():
    issues = issues_of(["npu_memory_utilization=2", "decode_batch=0", "+model=dsv4",
                        "model.cache_groups.1.name=ori", "model.cache_groups.3.row.dtype=int7"])
    paths = {i.path for i in issues}
    assert {"npu_memory_utilization", "decode_batch", "model.cache_groups[1].name",
            "model.cache_groups[3].row.dtype"} <= paths


def test_non_loopback_host_needs_tls_or_insecure():
    assert_issue(["server.host=0.0.0.0"], "server.host", ["TLS", "insecure"])
    load_runtime_config(["server.host=0.0.0.0", "server.insecure=true"])


def test_kv_overrides_are_exclusive():
    assert_issue(["kv_cache.kv_cache_memory_bytes=1000", "kv_cache.num_slots_override=2"],
                 "kv_cache.num_slots_override", ["at most one"])


def test_offline_profile_only_plans():
    assert_issue(["device=ascend_a3", "mode=serve"], "mode", ["offline", "plan"])


def test_unknown_default_model():
    assert_issue(["default_model=nope"], "default_model", ["nope", "dsv4_tiny"])


# -- the CLI, as a user runs it ---------------------------------------------------------------------

def test_cli_validation_error_exits_2_without_traceback(cli):
    proc = cli("mode=validate", "npu_memory_utilization=1.5", "decode_batch=0")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "npu_memory_utilization = 1.5: must be in (0, 1]" in proc.stderr
    assert "decode_batch = 0: must be a positive integer" in proc.stderr


@pytest.mark.parametrize("args,words", [
    (("decode_btch=3",), ["decode_btch"]),
    (("+model=nope",), ["model/nope", "dsv4_tiny"]),
    (("device=tpu",), ["device/tpu"]),
    (("decode_batch=1.5",), ["decode_batch", "1.5"]),
])
def test_cli_composition_errors_exit_2(cli, args, words):
    proc = cli("mode=validate", *args)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    for w in words:
        assert w in proc.stderr


def test_cli_validate_prints_groups_without_torch(cli):
    proc = cli("+model=dsv4", "mode=validate", "max_model_len=8192", env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "5,636,096" in proc.stdout and "csa_inner_state" in proc.stdout and "160,940,032" in proc.stdout
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "appliance.config.compose" in imported  # the import log really was captured
    assert not any(m == "torch" or m.startswith("torch.") for m in imported)


def test_architecture_rules_run_at_validate(cli):
    """The arch registry's rules are config rules: caught by mode=validate, not when a runner is built."""
    proc = cli("+model=qwen3_tiny", "model.cache_groups.0.row.width=32", "mode=validate")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "model.cache_groups[0].row.width = 32: must be 2 x num_kv_heads x head_dim = 64" in proc.stderr


def test_architecture_rules_name_key_paths():
    assert_issue(["model.layout.num_kv_heads=2", "+model=dsv4_tiny"], "model.layout.num_kv_heads", ["MQA", "1"])
    assert_issue(["+model=dsv4_tiny", "model.cache_groups.3.row.width=8"], "model.cache_groups[3].row.width",
                 ["idx", "16"])
    assert_issue(["+model=qwen3_tiny", "model.cache_groups.0.tokens_per_row=2", "model.cache_groups.0.rows_per_block=8"],
                 "model.cache_groups[0].tokens_per_row", ["one row per token"])


def test_a_layout_holds_only_its_architectures_keys():
    """Each arch has its own layout type: a DeepSeek key given to qwen3 is an error naming qwen3's keys, and a
    DeepSeek key without a default is required for deepseek_v4 (never a None the runner would trip on)."""
    assert_issue(["+model=qwen3_tiny", "model.layout.sliding_window=16"], "model.layout.sliding_window",
                 ["not a key of arch qwen3's layout", "intermediate_size"])
    assert_issue(["+model=dsv4_tiny", "model.layout.index_topk=???"], "model.layout.index_topk", ["deepseek_v4 needs it"])
    assert not hasattr(load_runtime_config(["+model=qwen3_tiny"]).model.layout, "sliding_window")


def test_step_budget_and_prefill_tiles_are_whole_blocks():
    assert_issue(["max_num_batched_tokens=8"], "max_num_batched_tokens", ["8", "block_size (16)"])
    assert_issue(["+model=dsv4", "model.layout.tokens_in_flight=200"], "model.layout.tokens_in_flight",
                 ["200", "multiple", "128"])
