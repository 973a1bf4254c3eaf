"""Typos are errors: any key the schema does not define fails with the closest valid key suggested, whether it
comes with '+', '++' or neither, at any depth; '+' only selects the groups that need it (+model=, +sweep=)."""

import pytest
from omegaconf import open_dict

from appliance.config.compose import compose, compose_runtime_config, load_runtime_config
from appliance.config.overrides import check_override_keys
from appliance.config.schema_keys import schema_key_issue
from appliance.core.errors import ConfigError


def issues(overrides):
    with pytest.raises(ConfigError) as err:
        load_runtime_config(overrides)
    return [str(i) for i in err.value.issues]


@pytest.mark.parametrize("overrides,expected", [
    (["+decode_btach=4"], ("decode_btach = 4: not a key of the schema (appliance/core/config.py); "
                           "did you mean decode_batch?")),
    (["decode_btach=4"], "did you mean decode_batch?"),
    (["++decode_btach=4"], "did you mean decode_batch?"),
    (["+model=dsv4", "+model.layout.slidng_window=3"], ("model.layout.slidng_window = 3: not a key of the schema "
                                                        "(appliance/core/config.py); did you mean "
                                                        "model.layout.sliding_window?")),
    (["+model=dsv4", "model.layout.hiden_size=3"], "did you mean model.layout.hidden_size?"),
    (["server.prot=1"], "did you mean server.port?"),
    (["+model=dsv4", "+model.cache_groups.1.row.widht=3"], "did you mean model.cache_groups.1.row.width?"),
    (["+kv_cache_memory_bytes=5"], "did you mean kv_cache.kv_cache_memory_bytes?"),   # right key, wrong level
    (["+model=dsv4", "+model.bogus=1"], ("model.bogus = 1: not a key of the schema (appliance/core/config.py); "
                                         "the keys under model are: name, arch, layout, cache_groups")),
    (["+decode_batch=4"], ("+decode_batch = 4: '+' adds a key, and decode_batch already exists: write "
                           "decode_batch=4 ('+' is only for the groups +model= and +sweep=)")),
])
def test_unknown_keys_name_the_closest_valid_key(overrides, expected):
    found = issues(overrides)
    assert len(found) == 1 and expected in found[0], found


@pytest.mark.parametrize("overrides,expected", [
    (["model.layout.sliding_window=32"], ("model.layout.sliding_window = 32: select a model first: +model=NAME (dsv4, "
                                          "dsv4_tiny, hf, qwen3, qwen3_tiny), e.g. +model=dsv4_tiny "
                                          "model.layout.sliding_window=32 (the embedded default)")),
    (["model.weights=/ckpt"], "e.g. +model=hf model.weights=/ckpt (a checkpoint directory, its layout read from "
                              "config.json), or +model=dsv4_tiny model.weights=/ckpt"),
    (["+model.weights=/ckpt"], "select a model first: +model=NAME"),
    (["default_model=qwen3_tiny", "model.name=x"], "e.g. +model=qwen3_tiny model.name=x (the embedded default)"),
    (["+model=dsv4_tine"], ("+model = 'dsv4_tine': no such model (conf/model/dsv4_tine.yaml); did you mean "
                            "+model=dsv4_tiny? the model options are: dsv4, dsv4_tiny, hf, qwen3, qwen3_tiny")),
    (["device=gpu,cpu"], "device = 'gpu': no such device (conf/device/gpu.yaml)"),
    (["+sweep=capcity"], "did you mean +sweep=capacity?"),
    (["model=dsv4"], "model = 'dsv4': the model group is not in the defaults list: select it with a leading '+', "
                     "+model=dsv4"),
    (["+device=cpu"], "+device = 'cpu': '+' only selects the groups outside the defaults list (+model=, +sweep=): "
                      "write device=cpu"),
])
def test_group_choices_and_model_keys_without_a_model_say_what_to_type(overrides, expected):
    """What Hydra answers with its search path or an OmegaConf traceback, said as the line to type instead."""
    found = issues(overrides)
    assert len(found) == 1 and expected in found[0], found


def test_groups_and_free_subtrees_stay_valid():
    check_override_keys(["+model=dsv4", "+sweep=capacity", "device=cpu", "server=default", "hydra/launcher=joblib",
                         "hydra.run.dir=x", "npu_memory_utilization=0.7,0.8", "++decode_batch=4",
                         "model.layout.sliding_window=32", "device=cpu,ascend_a3"])       # the model is selected
    assert schema_key_issue("model.cache_groups.2.layers.compress_ratio", 4) is None   # layers is free-form
    assert schema_key_issue("model.cache_groups[2].rows_per_block", 4) is None
    assert load_runtime_config(["++decode_batch=4"]).decode_batch == 4


def test_a_key_added_to_the_composed_config_by_any_route_is_caught():
    cfg = compose(["+model=dsv4_tiny"])
    with open_dict(cfg), open_dict(cfg.model.layout):
        cfg.decode_btach = 4
        cfg.model.layout.num_layerz = 3
    with pytest.raises(ConfigError) as err:
        compose_runtime_config(cfg)
    found = {i.path: i.rule for i in err.value.issues}
    assert found["decode_btach"].endswith("did you mean decode_batch?")
    assert found["model.layout.num_layerz"].endswith("did you mean model.layout.num_layers?")


@pytest.mark.parametrize("args,words", [
    (("+decode_btach=4",), ["decode_btach = 4", "did you mean decode_batch?"]),
    (("+model=dsv4", "+model.bogus=1"), ["model.bogus = 1", "the keys under model are"]),
    (("decode_btach=4",), ["did you mean decode_batch?"]),
])
def test_cli_typos_exit_2_without_traceback_or_hydras_plus_hint(cli, args, words):
    proc = cli("mode=validate", *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "To append to your config use +" not in proc.stderr
    assert proc.stderr.startswith("error: Invalid configuration (1 error):")
    for w in words:
        assert w in proc.stderr


def test_cli_typo_with_hydra_full_error_shows_the_traceback(cli):
    proc = cli("mode=validate", "+decode_btach=4", env={"HYDRA_FULL_ERROR": "1"})
    assert proc.returncode == 2 and "Traceback" in proc.stderr and "did you mean decode_batch?" in proc.stderr
