"""speculative.method / speculative.num_tokens: validated before any device work, each error naming its key;
on the command line one message and exit 2, no traceback."""

from __future__ import annotations

import pytest

from appliance.config.compose import load_runtime_config
from appliance.core.errors import ConfigError


def issue_paths(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load_runtime_config(list(overrides))
    return [i.path for i in err.value.issues]


@pytest.mark.parametrize("k", [0, 4, -1])
def test_num_tokens_outside_one_to_three_names_the_key(k):
    assert issue_paths("speculative.method=mtp", f"speculative.num_tokens={k}") == ["speculative.num_tokens"]


def test_an_unknown_method_names_the_key():
    assert issue_paths("speculative.method=eagle") == ["speculative.method"]


def test_mtp_needs_a_deepseek_v4_with_an_mtp_layer():
    assert issue_paths("+model=qwen3_tiny", "speculative.method=mtp") == ["speculative.method"]
    assert issue_paths("+model=dsv4_tiny", "speculative.method=mtp", "model.layout.num_mtp_layers=0",
                       "model.layout.compress_ratios=[0,4,16,4,16]") == ["speculative.method"]


def test_off_by_default_and_on_with_k_drafts():
    assert load_runtime_config([]).speculative.draft_tokens == 0
    rc = load_runtime_config(["speculative.method=mtp", "speculative.num_tokens=3"])
    assert rc.speculative.draft_tokens == 3 and rc.model.group("mtp").layer_ids == (rc.model.layout.num_layers,)


def test_cli_exits_2_naming_the_key(cli):
    out = cli("mode=plan", "speculative.method=mtp", "speculative.num_tokens=9")
    assert out.returncode == 2 and "speculative.num_tokens" in out.stderr and "Traceback" not in out.stderr
