"""The parts of DeepSeek V4 one at a time: Sinkhorn mixing, routing (hash and top-k), overlapping CSA pooling,
RoPE (YaRN against transformers), and the compressor-state ring figures with overlap."""

import math
import random

import pytest
import torch

from appliance.config.compose import load_runtime_config
from appliance.core.archs.deepseek_v4.cache_groups import state_span_pages
from appliance.core.archs.deepseek_v4.layout import csa_ratio
from appliance.core.step_limits import SeqShape, StepShape
from npu.deepseek_v4 import moe as moe_module
from npu.deepseek_v4.attention import pool_windows
from npu.deepseek_v4.hyper import hc_pre, sinkhorn
from npu.deepseek_v4.moe import route
from npu.deepseek_v4.paging import build_plan
from npu.deepseek_v4.rope import default_inv_freq, layer_ropes, yarn_inv_freq
from npu.deepseek_v4.runner import DeepseekV4Runner
from npu.step import SeqStep, StepBatch


def test_sinkhorn_mixing_is_doubly_stochastic():
    gen = torch.Generator().manual_seed(0)
    hc, d, n = 4, 16, 64
    streams = torch.randn(n, hc, d, generator=gen)
    fn = torch.randn((2 + hc) * hc, hc * d, generator=gen) * 0.1    # weights of a model's scale
    base = torch.randn((2 + hc) * hc, generator=gen)
    post, comb, collapsed = hc_pre(streams, fn, base, torch.ones(3), iters=20, hc_eps=1e-6, norm_eps=1e-6)
    assert comb.shape == (n, hc, hc) and (comb > 0).all()
    assert torch.allclose(comb.sum(dim=-1), torch.ones(n, hc), atol=1e-3)    # rows
    assert torch.allclose(comb.sum(dim=-2), torch.ones(n, hc), atol=1e-3)    # columns
    assert comb.std() > 0.05                                                 # not the trivial uniform matrix
    assert ((post > 0) & (post < 2)).all() and collapsed.shape == (n, d)
    one_pass = sinkhorn(torch.softmax(torch.randn(n, hc, hc, generator=gen) * 5, -1) + 1e-6, 1, 1e-6)
    assert not torch.allclose(one_pass.sum(dim=-1), torch.ones(n, hc), atol=1e-3)   # iterations matter


def released_sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """transformers' DeepseekV4HyperConnection loop, verbatim."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


@pytest.mark.parametrize("tokens", [1, 2, 7, 16, 33, 64, 100, 129])
def test_sinkhorn_is_bitwise_the_released_loop(tokens):
    """The padded in-place Sinkhorn adds and divides the same numbers in the same order as the released loop,
    for token counts on and off its padding multiple, and leaves its input alone."""
    gen = torch.Generator().manual_seed(tokens)
    for hc, iters in ((4, 20), (3, 5), (4, 1)):
        comb = torch.softmax(torch.randn(tokens, hc, hc, generator=gen) * 3, dim=-1) + 1e-6
        before = comb.clone()
        assert torch.equal(sinkhorn(comb, iters, 1e-6), released_sinkhorn(comb, iters, 1e-6))
        assert torch.equal(comb, before)


def test_hash_routing_picks_the_table_and_weights_sum_to_the_scale():
    gen = torch.Generator().manual_seed(1)
    n, dim, experts, k, vocab = 12, 16, 8, 2, 40
    h, gate = torch.randn(n, dim, generator=gen), torch.randn(experts, dim, generator=gen)
    table = torch.rand(vocab, experts, generator=gen).argsort(-1)[:, :k]
    tokens = torch.randint(0, vocab, (n,), generator=gen)
    weights, picked = route(h, gate, "sqrtsoftplus", k, 1.5, table=table, token_ids=tokens)
    assert torch.equal(picked, table[tokens])
    assert torch.allclose(weights.sum(-1), torch.full((n,), 1.5))
    bias = torch.zeros(experts)
    bias[3] = 100.0                                           # selection only: expert 3 always picked ...
    weights, picked = route(h, gate, "sqrtsoftplus", k, 1.5, bias=bias)
    assert (picked == 3).any(-1).all()
    assert torch.allclose(weights.sum(-1), torch.full((n,), 1.5))
    scores = torch.nn.functional.softplus(h @ gate.t()).sqrt()
    picked_scores = scores.gather(1, picked)
    assert torch.allclose(weights, picked_scores / picked_scores.sum(-1, keepdim=True) * 1.5)   # ... unweighted by it


def top_k_by_sorting(selection: torch.Tensor, k: int) -> list[set[int]]:
    """Each row's k largest entries, found by a full sort (not torch.topk, which route uses)."""
    return [set(row.argsort(descending=True)[:k].tolist()) for row in selection]


@pytest.mark.parametrize("scoring_func", ["sqrtsoftplus", "sigmoid"])
@pytest.mark.parametrize("k", [1, 2, 3, 6])
def test_learned_routing_picks_exactly_the_top_k_of_score_plus_bias(scoring_func, k):
    """As released (noaux_tc): the k experts of largest score + bias, k distinct ones per token; their weights
    are the unbiased scores, renormalized and scaled."""
    gen = torch.Generator().manual_seed(k)
    n, dim, experts = 32, 16, 8
    h, gate = torch.randn(n, dim, generator=gen), torch.randn(experts, dim, generator=gen)
    bias = torch.randn(experts, generator=gen)
    logits = h @ gate.t()
    scores = torch.sigmoid(logits) if scoring_func == "sigmoid" else torch.log1p(logits.exp()).sqrt()
    weights, picked = route(h, gate, scoring_func, k, 1.5, bias=bias)
    assert picked.shape == weights.shape == (n, k)
    assert [set(row.tolist()) for row in picked] == top_k_by_sorting(scores + bias, k)   # k distinct, the top k
    picked_scores = scores.gather(1, picked)
    assert torch.allclose(weights, picked_scores / picked_scores.sum(-1, keepdim=True) * 1.5, atol=1e-6)


def routed_per_layer(monkeypatch, seed: int, num_tokens: int):
    """One prefill step of the embedded default's runner on seeded random tokens, recording every layer's
    routed-experts call: (model, runner, tokens, [(hidden, weights, experts) per layer])."""
    m = load_runtime_config([]).model
    runner = DeepseekV4Runner(m, "cpu")
    runner.load_weights()
    runner.allocate_pools({s.name: s.max_blocks_per_seq for s in m.cache_groups}, 1)
    seen = []
    real = moe_module.routed_experts
    monkeypatch.setattr("npu.deepseek_v4.runner.routed_experts",
                        lambda h, w, e, *a: seen.append((h, w, e)) or real(h, w, e, *a))
    tokens = [random.Random(seed).randrange(m.layout.vocab_size) for _ in range(num_tokens)]
    tables = {s.name: list(range(s.max_blocks_per_seq)) for s in m.cache_groups}
    runner.execute(StepBatch([SeqStep("r", tokens, 0, tables)]))
    assert len(seen) == m.layout.num_layers
    return m, runner, tokens, seen


def test_runner_hash_layers_route_by_tid2eid(monkeypatch):
    """Through the runner: layer 0 (num_hash_layers = 1) sends each token to exactly tid2eid[token], the
    other layers to learned top-k experts; every token's routing weights sum to routed_scaling_factor."""
    m, runner, tokens, seen = routed_per_layer(monkeypatch, seed=0, num_tokens=9)
    table = runner.params["layers.0.ffn.gate.tid2eid"]
    assert torch.equal(seen[0][2], table[torch.tensor(tokens)])
    assert not torch.equal(seen[1][2], table[torch.tensor(tokens)])
    for _, weights, _ in seen:
        assert torch.allclose(weights.sum(-1), torch.full((len(tokens),), m.layout.routed_scaling_factor))


def test_runner_routes_every_token_to_exactly_k_experts_in_every_layer(monkeypatch):
    """Every layer, hashed or learned, sends each token to num_experts_per_tok distinct experts; a learned
    layer's are the top k of sqrtsoftplus(h Wg) + bias, recomputed here from the layer's input and weights."""
    m, runner, tokens, seen = routed_per_layer(monkeypatch, seed=1, num_tokens=11)
    k = m.layout.num_experts_per_tok
    assert 1 < k < m.layout.num_experts and m.layout.num_hash_layers >= 1
    for layer, (h, _, experts) in enumerate(seen):
        assert experts.shape == (len(tokens), k), layer
        assert all(len(set(row.tolist())) == k for row in experts), layer
        if layer < m.layout.num_hash_layers:
            table = runner.params[f"layers.{layer}.ffn.gate.tid2eid"]
            assert table.shape[1] == k and torch.equal(experts, table[torch.tensor(tokens)])
            continue
        gate = runner.params[f"layers.{layer}.ffn.gate.weight"].float()
        bias = runner.params[f"layers.{layer}.ffn.gate.bias"].float()
        scores = torch.log1p((h.float() @ gate.t()).exp()).sqrt()
        assert [set(row.tolist()) for row in experts] == top_k_by_sorting(scores + bias, k), layer


def window_rows(num_windows: int, ratio: int, width: int, ca: float, cb: float) -> torch.Tensor:
    """State rows of an overlapping compressor for num_windows complete windows read the way the runner
    reads them: [J, 2 ratio, 4 width] = the previous window's tokens then this window's, each [kv | score]
    with kv = [Ca ..., Cb ...] and score 0 (every contributing token weighs the same)."""
    kv = torch.cat([torch.full((width,), ca), torch.full((width,), cb)])
    row = torch.cat([kv, torch.zeros(2 * width)])
    return row.expand(num_windows, 2 * ratio, 4 * width).clone()


def test_csa_row_0_pools_4_tokens_and_later_rows_8():
    ratio, width, j = 4, 8, 3
    ok = torch.ones(j, 2 * ratio, dtype=torch.bool)
    ok[0, :ratio] = False                                     # window -1 does not exist
    only_ca = pool_windows(window_rows(j, ratio, width, 1.0, 0.0), ok, ratio, width, True, torch.float32)
    only_cb = pool_windows(window_rows(j, ratio, width, 0.0, 1.0), ok, ratio, width, True, torch.float32)
    # row 0: the 4 tokens of window 0 (their second halves) and nothing else
    assert torch.allclose(only_ca[0], torch.zeros(width)) and torch.allclose(only_cb[0], torch.ones(width))
    # later rows: 8 tokens, 4 first halves of the previous window and 4 second halves of this one
    assert torch.allclose(only_ca[1:], torch.full((j - 1, width), 0.5))
    assert torch.allclose(only_cb[1:], torch.full((j - 1, width), 0.5))
    plain = pool_windows(torch.cat([torch.ones(j, ratio, width), torch.zeros(j, ratio, width)], -1),
                         torch.ones(j, ratio, dtype=torch.bool), ratio, width, False, torch.float32)
    assert torch.allclose(plain, torch.ones(j, width))       # HCA: one window, no overlap


def test_yarn_and_thetas_match_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    lay = load_runtime_config(["+model=dsv4"]).model.layout
    cfg = transformers.DeepseekV4Config(
        rope_theta=lay.rope_theta, compress_rope_theta=lay.compress_rope_theta, qk_rope_head_dim=lay.qk_rope_head_dim,
        rope_scaling={"type": "yarn", "factor": lay.yarn_factor, "beta_fast": lay.yarn_beta_fast,
                      "beta_slow": lay.yarn_beta_slow,
                      "original_max_position_embeddings": lay.yarn_original_max_position_embeddings})
    theirs, scaling = ROPE_INIT_FUNCTIONS["yarn"](cfg, layer_type="compress")
    ropes = layer_ropes(lay, torch.device("cpu"), torch.float32)
    assert scaling == 1.0 and torch.equal(ropes[True].inv_freq, theirs)
    assert torch.equal(ropes[False].inv_freq, default_inv_freq(lay.rope_theta, lay.qk_rope_head_dim))
    plain = default_inv_freq(lay.compress_rope_theta, lay.qk_rope_head_dim)
    assert torch.equal(ropes[True].inv_freq[:4], plain[:4])                     # fast frequencies kept
    assert torch.allclose(ropes[True].inv_freq[-4:], plain[-4:] / lay.yarn_factor)   # slow ones interpolated
    assert not torch.equal(yarn_inv_freq(160000.0, 64, 16.0, 65536, 32, 1), plain)


def test_rope_rotates_interleaved_pairs_and_back():
    rope = layer_ropes(load_runtime_config([]).model.layout, torch.device("cpu"), torch.float32)[True]
    x = torch.randn(5, 3, 32)
    pos = torch.arange(5) * 7
    rotated = rope.at(pos).apply(x)
    assert torch.equal(rotated[..., :24], x[..., :24])                          # nope channels untouched
    pair_norm = lambda t: t[..., 24:].unflatten(-1, (-1, 2)).norm(dim=-1)  # noqa: E731
    assert torch.allclose(pair_norm(rotated), pair_norm(x), atol=1e-5)          # pairs (2i, 2i + 1) rotate
    assert torch.allclose(rope.at(pos).apply(rotated, inverse=True), x, atol=1e-5)


@pytest.mark.parametrize("overrides", [[], ["+model=dsv4"]])
def test_csa_state_ring_figure_holds_for_the_schedulers_chunks(overrides):
    """Overlap makes a compressing step read the previous window's state rows too. For the scheduler's
    chunking (multi-token steps start on block boundaries, decode steps anywhere) that still fits DESIGN's
    ring figure (65 pages for dsv4: ceil((4 + 256) / 4)), because the extra window is exactly the ratio
    tokens the aligned ring already holds; a tokens_in_flight chunk from mid-window would need one more."""
    rc = load_runtime_config(overrides)
    lay, block = rc.model.layout, rc.model.layout.block_size
    csa, tif = csa_ratio(lay), lay.tokens_in_flight
    for name in ("csa_state", "csa_inner_state"):
        spec = rc.model.group(name)
        assert spec.max_blocks_per_seq == math.ceil((csa + tif) / spec.tokens_per_page)
        def need(start: int, n: int, pages: int = spec.tokens_per_page) -> int:
            return state_span_pages(start, n, csa, pages, overlap=True)

        aligned = max(need(start, n) for start in range(0, 4 * block, block) for n in range(1, tif + 1))
        decode = max(need(start, 1) for start in range(4 * block))
        assert aligned == spec.max_blocks_per_seq and decode <= spec.max_blocks_per_seq
        assert max(need(start, tif) for start in range(block, 2 * block)) == spec.max_blocks_per_seq + 1
    if overrides:
        assert rc.model.group("csa_state").max_blocks_per_seq == 65
    hca = rc.model.group("hca_state")
    ratio = max(lay.main_layer_ratios)
    assert max(state_span_pages(start, n, ratio, hca.tokens_per_page, overlap=False)
               for start in range(0, 2 * ratio, block) for n in range(1, tif + 1)) <= hca.max_blocks_per_seq


def test_queries_are_grouped_by_length_never_padded():
    """Decode rows, a long chunk and short chunks in one step: each length is one group of equal-length
    sequences, a contiguous [S, Q] block of the flat tokens (no query padded to a longer one), and the logits
    rows come back in batch order."""
    rc = load_runtime_config(["+model=dsv4_tiny"])
    runner = DeepseekV4Runner(rc.model, "cpu")
    runner.allocate_pools({s.name: 0 for s in rc.model.cache_groups}, 8)
    shapes = [(2, 16), (1, 40), (32, 0), (1, 7), (2, 0), (5, 32), (1, 99)]       # (tokens, start) in batch order
    batch = runner.scratch_batch(StepShape("mixed", tuple(SeqShape(n, start) for n, start in shapes)))
    plan = build_plan(rc.model, batch, list(runner.kinds.values()), runner.device)
    by_length = sorted(range(len(shapes)), key=lambda i: shapes[i][0])
    groups = [(g.first, g.num_seqs, g.q_len) for g in plan.groups]
    assert groups == [(0, 3, 1), (3, 2, 2), (7, 1, 5), (12, 1, 32)]
    assert sum(n for n, _ in shapes) == len(plan.token_ids) == sum(g.num_seqs * g.q_len for g in plan.groups)
    assert plan.pos.tolist() == [p for i in by_length for p in range(shapes[i][1], sum(shapes[i]))]
    ends = {i: sum(shapes[j][0] for j in by_length[:by_length.index(i) + 1]) - 1 for i in range(len(shapes))}
    assert plan.sample_index.tolist() == [ends[i] for i in range(len(shapes))]
    for g in plan.groups:
        assert g.window_mask.shape == (g.num_seqs, g.q_len, g.q_len + rc.model.layout.sliding_window - 1)
        assert g.view(plan.pos).shape == (g.num_seqs, g.q_len)


def test_a_plan_for_another_device_has_every_tensor_there():
    """The plan is built on the host; for another device every index and mask is moved (a CPU plan is not)."""
    rc = load_runtime_config(["+model=dsv4_tiny"])
    runner = DeepseekV4Runner(rc.model, "cpu")
    runner.allocate_pools({s.name: 0 for s in rc.model.cache_groups}, 8)
    batch = runner.scratch_batch(StepShape("mixed", (SeqShape(1, 40), SeqShape(32, 0), SeqShape(5, 32))))
    kinds = list(runner.kinds.values())
    host, meta = build_plan(rc.model, batch, kinds, torch.device("cpu")), build_plan(rc.model, batch, kinds,
                                                                                    torch.device("meta"))

    def tensors(plan):
        rows = [*plan.rows.values(), *(r for g in plan.groups for r in g.keys.values())]
        return [plan.token_ids, plan.pos, plan.sample_index, *plan.run_pos.values(),
                *(t for r in rows for t in (r.page, r.row, r.ok)),
                *(t for g in plan.groups for t in (g.window_mask, *g.visible.values()))]

    assert len(tensors(host)) == len(tensors(meta)) > 20
    assert [(g.first, g.num_seqs, g.q_len) for g in meta.groups] == [(g.first, g.num_seqs, g.q_len) for g in host.groups]
    assert all(t.device.type == "cpu" for t in tensors(host))
    assert all(t.device.type == "meta" for t in tensors(meta))
    assert [t.shape for t in tensors(host)] == [t.shape for t in tensors(meta)]
