"""prefix_caching_ties resolved per model (appliance/core/prefix_reuse.py): DeepSeek V4 keys prefix hits by the
prompt's length from the indexer's first top-k choice on when ties are likely (few indexer heads) or when asked,
and says which in a startup note; an architecture whose pages depend on tokens alone has nothing to choose."""

from __future__ import annotations

import pytest

from appliance.config.compose import load_runtime_config
from appliance.core.archs import architecture
from appliance.core.errors import ConfigError
from appliance.core.prefix_reuse import exact_prefix_from


def resolved(*overrides: str) -> tuple[int | None, str | None]:
    rc = load_runtime_config(list(overrides))
    return exact_prefix_from(rc.prefix_caching_ties, architecture(rc.model.arch).length_dependent_kv(rc.model.layout))


def test_the_first_indexer_choice_is_where_a_query_sees_more_rows_than_it_picks():
    # index_topk + 1 rows are visible once (index_topk + 1) x ratio - 1 tokens precede and include the query
    assert resolved("+model=dsv4", "prefix_caching_ties=exact")[0] == (512 + 1) * 4 - 1
    assert resolved("+model=dsv4_tiny", "prefix_caching_ties=exact")[0] == (4 + 1) * 4 - 1


@pytest.mark.parametrize("heads, keyed", [(2, 19), (15, 19), (16, None), (64, None)])
def test_auto_keys_hits_by_length_only_with_few_indexer_heads(heads, keyed):
    position, note = resolved("+model=dsv4_tiny", f"model.layout.index_num_heads={heads}")
    assert position == keyed
    relation = "<" if keyed else ">="
    assert f"prefix_caching_ties=auto (model.layout.index_num_heads={heads} {relation} 16" in note
    assert ("hits only between prompts of the same length" in note) == (keyed is not None)


def test_an_explicit_choice_wins_over_the_heads():
    assert resolved("+model=dsv4_tiny", "model.layout.index_num_heads=64", "prefix_caching_ties=exact")[0] == 19
    position, note = resolved("+model=dsv4_tiny", "model.layout.index_num_heads=2", "prefix_caching_ties=reuse")
    assert position is None and "every cached prefix is reused, also past position 19" in note


def test_qwen3_pages_depend_on_tokens_alone():
    assert resolved("+model=qwen3_tiny", "prefix_caching_ties=exact") == (None, None)


def test_an_unknown_choice_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"prefix_caching_ties.*must be one of \['auto', 'exact', 'reuse'\]"):
        load_runtime_config(["prefix_caching_ties=sometimes"])
