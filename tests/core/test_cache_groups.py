"""Cache groups derived in core from typed values (no Hydra, no DictConfig): declared groups + a frozen layout ->
CacheGroupSpecs, every fault a ConfigIssue with its key path."""

import math

from appliance.core.archs.deepseek_v4.layout import DeepseekV4Layout
from appliance.core.archs.qwen3.layout import Qwen3Layout
from appliance.core.cache_groups import derive_cache_groups
from appliance.core.checks import Checker
from appliance.core.kv_cache_spec import CacheGroupSettings, RowSettings

QWEN = Qwen3Layout(hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=512,
                   block_size=16, max_model_len_cap=2048, intermediate_size=128)
DSV4 = DeepseekV4Layout(hidden_size=64, num_layers=4, num_mtp_layers=1, num_heads=4, num_kv_heads=1, head_dim=32,
                        vocab_size=512, block_size=16, max_model_len_cap=1024, sliding_window=16,
                        compress_ratios=(0, 4, 16, 4, 0), index_head_dim=16, index_num_heads=4, index_topk=4,
                        tokens_in_flight=32, q_lora_rank=32, qk_rope_head_dim=8, o_groups=2, o_lora_rank=16,
                        compress_rope_theta=160000.0, num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=32, swiglu_limit=10.0, hc_mult=4)
ROW = RowSettings(dtype="float32", width=64)


def test_a_full_group_covers_max_model_len_in_whole_blocks():
    c = Checker()
    (kv,) = derive_cache_groups(c, (CacheGroupSettings(name="kv", rows_per_block=16, row=ROW, history="full"),),
                                QWEN, max_model_len=100)
    assert c.issues == []
    assert kv.layer_ids == (0, 1, 2) and kv.max_blocks_per_seq == math.ceil(100 / 16)


def test_ring_groups_take_their_span_from_the_layout_or_the_selected_ratio():
    c = Checker()
    window, state = derive_cache_groups(c, (
        CacheGroupSettings(name="ori", rows_per_block=16, row=ROW, history="ring", ring_span="sliding_window"),
        CacheGroupSettings(name="st", layers={"compress_ratio": 4}, rows_per_block=4, row=ROW, history="ring",
                           ring_span="compress_ratio", ring_aligned=True),
    ), DSV4, max_model_len=512)
    assert c.issues == []
    assert window.ring_span_tokens == DSV4.sliding_window and window.layer_ids == (0, 1, 2, 3)
    # window 16 reaches 15 back, plus 32 tokens in flight, on 16-token pages, plus the page it starts inside
    assert window.max_blocks_per_seq == math.ceil((16 - 1 + 32) / 16) + 1
    assert state.layer_ids == (1, 3) and state.ring_span_tokens == 4 and state.max_blocks_per_seq == math.ceil(36 / 4)


def test_a_layout_without_a_window_cannot_serve_a_window_ring():
    c = Checker()
    derive_cache_groups(c, (CacheGroupSettings(name="kv", rows_per_block=16, row=ROW, history="ring",
                                               ring_span="sliding_window"),), QWEN, max_model_len=64)
    assert [(i.path, i.value) for i in c.issues] == [("model.cache_groups[0].ring_span", "sliding_window")]
    assert "compress_ratio" in c.issues[0].rule


def test_every_fault_is_reported_with_its_key_path():
    c = Checker()
    derive_cache_groups(c, (
        CacheGroupSettings(name="a", layers=(0, 7), rows_per_block=16, row=ROW, history="full"),
        CacheGroupSettings(name="a", rows_per_block=8, row=ROW, history="full"),
        CacheGroupSettings(name="b", layers={"compress_ratio": 8}, rows_per_block=2, tokens_per_row=8, row=ROW,
                           history="full"),
    ), DSV4, max_model_len=64)
    assert {i.path for i in c.issues} == {"model.cache_groups[0].layers", "model.cache_groups[1].name",
                                         "model.cache_groups[1].rows_per_block",
                                         "model.cache_groups[2].layers.compress_ratio"}
