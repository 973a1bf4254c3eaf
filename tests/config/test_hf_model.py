"""`+model=hf model.weights=DIR`: the model from the checkpoint's config.json (Qwen3 as transformers writes it,
DeepSeek V4 in transformers' DeepseekV4Config format): the same layout and cache groups as the hand-written
model YAMLs, disagreements naming both values, unknown architectures listing the supported ones."""

from __future__ import annotations

import dataclasses
import json

import pytest

from appliance.config.compose import load_runtime_config
from appliance.core.archs import HF_ARCHITECTURES
from appliance.core.errors import ConfigError
from tests.support.checkpoints import write_tiny_checkpoint

transformers = pytest.importorskip("transformers")

def differing_fields(a, b) -> set[str]:
    return {f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(b, f.name)}


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    rc = load_runtime_config(["+model=qwen3_tiny"])
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), rc.model, seed=1), rc


def test_qwen3_checkpoint_gives_the_yaml_layout_and_groups(qwen3_dir):
    path, yaml_rc = qwen3_dir
    rc = load_runtime_config(["+model=hf", f"model.weights={path}"])
    assert rc.model.arch == "qwen3" and rc.model.name == path.name and rc.model.weights == str(path)
    assert rc.model.layout == yaml_rc.model.layout and rc.model.cache_groups == yaml_rc.model.cache_groups


def test_transformers_written_qwen3_config(tmp_path):
    """transformers 5 writes rope_parameters and dtype; a YAML value for a config-free key is kept."""
    config = transformers.Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                                      max_position_embeddings=4096, rope_parameters={"rope_type": "default",
                                                                                     "rope_theta": 5e5},
                                      dtype="bfloat16", architectures=["Qwen3ForCausalLM"])
    config.save_pretrained(tmp_path)
    rc = load_runtime_config(["+model=hf", f"model.weights={tmp_path}", "model.layout.block_size=32"])
    lay = rc.model.layout
    assert (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.intermediate_size, lay.rope_theta, lay.dtype,
            lay.max_model_len_cap, lay.block_size) == (3, 1, 32, 96, 5e5, "bfloat16", 4096, 32)
    [kv] = rc.model.cache_groups
    assert (kv.name, kv.rows_per_block, kv.row_width, kv.row_dtype) == ("kv", 32, 2 * 1 * 32, "bfloat16")


def test_yaml_values_that_disagree_name_both(qwen3_dir):
    path, _ = qwen3_dir
    with pytest.raises(ConfigError) as info:
        load_runtime_config(["+model=hf", f"model.weights={path}", "model.layout.num_layers=3",
                             "model.layout.rope_theta=10000", "model.arch=deepseek_v4"])
    text = str(info.value)
    assert "model.layout.num_layers = 3: disagrees with" in text and "num_hidden_layers=2" in text
    assert "model.layout.rope_theta = 10000.0: disagrees with" in text and "rope_theta=1000000.0" in text
    assert "model.arch = 'deepseek_v4': disagrees with" in text and "Qwen3ForCausalLM" in text
    # A value that agrees is fine.
    load_runtime_config(["+model=hf", f"model.weights={path}", "model.layout.num_layers=2"])


def test_unknown_architecture_lists_the_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ConfigError) as info:
        load_runtime_config(["+model=hf", f"model.weights={tmp_path}"])
    assert "['LlamaForCausalLM'] is not supported" in str(info.value)
    assert str(sorted(HF_ARCHITECTURES)) in str(info.value)
    assert sorted(HF_ARCHITECTURES) == ["DeepseekV4ForCausalLM", "Qwen3ForCausalLM"]


# A complete Qwen3 config.json as transformers writes its shape keys (the optional ones left out).
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512, "hidden_size": 64,
         "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
         "head_dim": 16}
DSV4_SHAPES = {"architectures": ["DeepseekV4ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 3,
               "num_attention_heads": 4, "head_dim": 32, "vocab_size": 512, "q_lora_rank": 32,
               "qk_rope_head_dim": 8, "o_groups": 2, "o_lora_rank": 16, "index_head_dim": 16, "index_n_heads": 2,
               "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "hc_mult": 2}


@pytest.mark.parametrize("config, message", [
    (None, "does not exist"),
    ({**QWEN3, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "rope_scaling: {'rope_type': 'yarn', 'factor': 4.0} is not supported"),
    ({**QWEN3, "use_sliding_window": True}, "use_sliding_window"),
    ({**DSV4_SHAPES}, "needs layer_types"),
])
def test_bad_checkpoint_configs_are_config_errors(tmp_path, config, message):
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="model.weights") as info:
        load_runtime_config(["+model=hf", f"model.weights={tmp_path}"])
    assert message in str(info.value)
    with pytest.raises(ConfigError, match="give model.weights=DIR"):
        load_runtime_config(["+model=hf"])


def test_deepseek_v4_flash_config_gives_the_dsv4_yaml_groups(tmp_path):
    """transformers' DeepseekV4Config for the Flash layout as released (YaRN, FP8 linears, FP4 experts) ->
    exactly conf/model/dsv4.yaml's layout and seven cache groups."""
    flash = load_runtime_config(["+model=dsv4", "device=ascend_a3", "mode=validate", "max_model_len=8192"])
    main_ratios = list(flash.model.layout.compress_ratios[:flash.model.layout.num_layers])
    transformers.DeepseekV4Config(
        compress_ratios=main_ratios, dtype="bfloat16", architectures=["DeepseekV4ForCausalLM"], expert_dtype="fp4",
        rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                      "beta_slow": 1},
        quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                             "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}).save_pretrained(tmp_path)
    rc = load_runtime_config(["+model=hf", f"model.weights={tmp_path}", "device=ascend_a3", "mode=validate",
                              "max_model_len=8192"])
    assert rc.model.arch == "deepseek_v4"
    # idx keeps transformers' float keys (bf16 x 128: 2 x dsv4.yaml's fp8 + scale); every other group is the same
    float_idx = [dataclasses.replace(g, row_dtype="bfloat16", row_extra_bytes=0) if g.name == "idx" else g
                 for g in flash.model.cache_groups]
    assert list(rc.model.cache_groups) == float_idx
    assert (rc.model.group("idx").page_size_bytes, flash.model.group("idx").page_size_bytes) == (172_032, 88_704)
    assert differing_fields(rc.model.layout, flash.model.layout) == set()


def test_tiny_deepseek_v4_config_with_layer_types_validates(tmp_path, cli):
    layer_types = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                   "compressed_sparse_attention", "heavily_compressed_attention"]
    transformers.DeepseekV4Config(
        vocab_size=512, hidden_size=64, num_hidden_layers=5, num_attention_heads=4, head_dim=32, q_lora_rank=32,
        moe_intermediate_size=128, n_routed_experts=4, num_experts_per_tok=2, sliding_window=16, index_n_heads=2,
        index_head_dim=16, index_topk=8, layer_types=layer_types, dtype="float32",
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        architectures=["DeepseekV4ForCausalLM"]).save_pretrained(tmp_path)
    rc = load_runtime_config(["+model=hf", f"model.weights={tmp_path}", "model.layout.block_size=16",
                              "model.layout.tokens_in_flight=32", "max_model_len=256"])
    tiny = load_runtime_config(["+model=dsv4_tiny", "max_model_len=256"])
    assert rc.model.layout.compress_ratios == tiny.model.layout.compress_ratios
    same = {g.name for g in rc.model.cache_groups} & {g.name for g in tiny.model.cache_groups}
    assert same == {g.name for g in tiny.model.cache_groups}
    result = cli("+model=hf", f"model.weights={tmp_path}", "model.layout.block_size=16", "mode=validate",
                 "model.layout.tokens_in_flight=32", "max_model_len=256")
    assert result.returncode == 0, result.stderr
    assert "cmp_c16" in result.stdout and "csa_inner_state" in result.stdout


def test_cli_disagreement_exits_2(qwen3_dir, cli):
    path, _ = qwen3_dir
    result = cli("+model=hf", f"model.weights={path}", "model.layout.head_dim=8", "mode=validate")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "model.layout.head_dim = 8: disagrees with" in result.stderr and "head_dim=16" in result.stderr


def without(config: dict, key: str) -> dict:
    return {k: v for k, v in config.items() if k != key}


# Issue 24 item 4: every malformed config.json is one message naming the file and the key (and what the key
# must hold), never a traceback, a char-by-char list or a silently guessed shape.
BAD_CONFIGS = {
    "a list": ([QWEN3], "(top level): is a JSON list, not an object"),
    "null": (None, "(top level): is a JSON null, not an object"),
    "a float width": ({**QWEN3, "hidden_size": 64.5}, "hidden_size: 64.5 is not an integer"),
    "a bool layer count": ({**QWEN3, "num_hidden_layers": True}, "num_hidden_layers: true is not an integer"),
    "a string layer count": ({**QWEN3, "num_hidden_layers": "2"}, 'num_hidden_layers: "2" is not an integer'),
    "a string eps": ({**QWEN3, "rms_norm_eps": "1e-6"}, 'rms_norm_eps: "1e-6" is not a finite number'),
    "an int for a bool": ({**QWEN3, "tie_word_embeddings": 1}, "tie_word_embeddings: 1 is not true or false"),
    "a number dtype": ({**QWEN3, "dtype": 16}, "dtype: 16 is not a string"),
    "a float context": ({**QWEN3, "max_position_embeddings": 4096.5}, "max_position_embeddings: 4096.5 is not an"),
    "a string theta": ({**QWEN3, "rope_parameters": {"rope_type": "default", "rope_theta": "1e6"}},
                       'rope_parameters.rope_theta: "1e6" is not a finite number'),
    "architectures a string": ({**QWEN3, "architectures": "Qwen3ForCausalLM"},
                               'architectures: "Qwen3ForCausalLM" is not a list of strings'),
    "hidden_size missing": (without(QWEN3, "hidden_size"), "hidden_size: is missing from config.json"),
    "head_dim missing": (without(QWEN3, "head_dim"), "head_dim: is missing from config.json"),
    "model_type of another arch": ({**QWEN3, "model_type": "deepseek_v4"}, 'model_type: "deepseek_v4" disagrees'),
    "dsv4 hidden_size missing": (without(DSV4_SHAPES, "hidden_size"), "hidden_size: is missing"),
    "dsv4 float experts": ({**DSV4_SHAPES, "n_routed_experts": 4.0}, "n_routed_experts: 4.0 is not an integer"),
    "dsv4 layer_types a string": ({**DSV4_SHAPES, "layer_types": "sliding_attention"},
                                  'layer_types: "sliding_attention" is not a list of strings'),
    "dsv4 fractional rope dims": ({**without(DSV4_SHAPES, "qk_rope_head_dim"), "partial_rotary_factor": 0.3,
                                   "layer_types": ["sliding_attention"] * 3}, "partial_rotary_factor: 0.3 x head_dim"),
}


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_malformed_config_json_is_one_message_naming_file_and_key(tmp_path, case):
    config, message = BAD_CONFIGS[case]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as info:
        load_runtime_config(["+model=hf", f"model.weights={tmp_path}"])
    [issue] = info.value.issues
    assert issue.path == "model.weights"
    assert f"{tmp_path / 'config.json'}: {message}" in issue.rule


def test_a_float_compress_rate_is_named(tmp_path):
    """Only a compressed layer reads its rate: the float reaches the layout and is refused there."""
    config = {**DSV4_SHAPES, "layer_types": ["sliding_attention", "compressed_sparse_attention",
                                             "heavily_compressed_attention"],
              "compress_rates": {"compressed_sparse_attention": 4.5}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as info:
        load_runtime_config(["+model=hf", f"model.weights={tmp_path}"])
    assert "config.json: layer_types: [0, 4.5, 128, 0] is not a list of integers" in str(info.value)


@pytest.mark.parametrize("case", ["a list", "a float width", "hidden_size missing", "architectures a string"])
def test_cli_malformed_config_json_exits_2_without_traceback(tmp_path, cli, case):
    config, message = BAD_CONFIGS[case]
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    result = cli("+model=hf", f"model.weights={tmp_path / 'ckpt'}", "mode=validate")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and message in result.stderr and "config.json" in result.stderr


# Issue 32 item 6: text json.loads cannot take (a traceback, exit 1), and values no model can run with.
BAD_TEXTS = {
    "nested 100,000 deep": (json.dumps(QWEN3)[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}",
                            "is not valid JSON: arrays and objects nested more than 64 deep"),
    "a 5,000-digit integer": (json.dumps(QWEN3)[:-1] + ', "x": ' + "7" * 5000 + "}",
                              "is not valid JSON: a number of 5,000 digits in a row (at most 100)"),
}


@pytest.mark.parametrize("case", BAD_TEXTS)
def test_config_json_beyond_the_json_bounds_is_one_message_naming_the_file(tmp_path, case):
    text, message = BAD_TEXTS[case]
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ConfigError) as info:
        load_runtime_config(["+model=hf", f"model.weights={tmp_path}"])
    [issue] = info.value.issues
    assert issue.path == "model.weights" and f"{tmp_path / 'config.json'} {message}" in issue.rule


def test_cli_config_json_nested_too_deep_exits_2_without_traceback(tmp_path, cli):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(BAD_TEXTS["nested 100,000 deep"][0])
    result = cli("+model=hf", f"model.weights={tmp_path / 'ckpt'}", "mode=validate")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "config.json is not valid JSON: arrays and objects nested more than 64 deep" in result.stderr


@pytest.mark.parametrize("eps", [-1, 0, 0.0])
def test_a_non_positive_rms_norm_eps_is_refused_naming_the_key(tmp_path, eps):
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3, "rms_norm_eps": eps}))
    with pytest.raises(ConfigError) as info:
        load_runtime_config(["+model=hf", f"model.weights={tmp_path}"])
    [issue] = info.value.issues
    assert (issue.path, issue.rule) == ("model.layout.rms_norm_eps", "must be a finite number > 0")


def test_optional_keys_take_transformers_defaults(tmp_path):
    """The documented optional keys: left out, they are what transformers' Qwen3Config assumes."""
    (tmp_path / "config.json").write_text(json.dumps(without(QWEN3, "num_key_value_heads")))
    lay = load_runtime_config(["+model=hf", f"model.weights={tmp_path}"]).model.layout
    assert (lay.num_kv_heads, lay.rms_norm_eps, lay.rope_theta, lay.tie_word_embeddings, lay.max_model_len_cap,
            lay.dtype) == (4, 1e-6, 10000.0, False, 32768, "float32")


@pytest.mark.parametrize("other", [{"architectures": ["DeepseekV4ForCausalLM"]}, {"model_type": "deepseek_v4"}],
                         ids=["architectures", "model_type"])
def test_model_yaml_refuses_a_checkpoint_of_another_architecture(tmp_path, cli, other):
    """+model=qwen3_tiny with a checkpoint whose config.json says DeepSeek V4: refused at validate, exit 2."""
    config = {**QWEN3, **other}
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    result = cli("+model=qwen3_tiny", f"model.weights={tmp_path / 'ckpt'}", "mode=validate")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert "is not a qwen3 checkpoint: config.json says" in result.stderr and any(name in result.stderr for name in ("['DeepseekV4ForCausalLM']", "'deepseek_v4'"))


def test_model_yaml_refuses_a_config_json_of_the_wrong_kind(tmp_path, cli):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({**QWEN3, "num_hidden_layers": True}))
    result = cli("+model=qwen3_tiny", f"model.weights={tmp_path / 'ckpt'}", "mode=validate")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "config.json': num_hidden_layers: true is not an integer" in result.stderr
