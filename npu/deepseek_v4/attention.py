"""DeepSeek V4 attention of one layer over the paged cache groups.

- Queries: q_r = q_norm(x wq_a) (the q-LoRA latent), q = RMS(q_r wq_b) per head (no weight), RoPE.
- One shared key-and-value row per token: kv_norm(x wkv), RoPE; written to `ori` (the sliding window).
- Compressed layers (ratio r): each token writes a state row [x wkv_c, x wgate_c + ape[t mod r]] (kv and
  score); when window i (tokens [i r, (i + 1) r)) is complete, row i of cmp_c{r} is
  RoPE@(i r)(norm(sum_t softmax_t(score_t) kv_t)), softmax per channel over the window's tokens. CSA (the
  smallest ratio) overlaps: its compressors are 2 x width wide and row i pools the first half of window
  i - 1 and the second half of window i (window -1 is empty). HCA (the largest) does not overlap. Row i
  is visible to the query at t once (i + 1) r - 1 <= t.
- HCA attends to every visible compressed row; CSA to the index_topk visible rows with the highest
  lightning-indexer score sum_h w_h relu(q_h . k_i) / sqrt(index_head_dim), w = x weights_proj /
  sqrt(index_num_heads), q from the q-LoRA latent (indexer.wq_b, RoPE), keys compressed like CSA's into
  `idx` (ties broken as torch.topk breaks them in transformers, see Attention._index).
- One softmax over window rows, compressed rows and a learned per-head sink logit (scale 1/sqrt(head_dim));
  the output's RoPE channels are rotated back at the query position, then the grouped output projection:
  heads in o_groups groups, each projected by its block of wo_a, then wo_b.
Window-only layers use RoPE with rope_theta, compressed layers (their compressors and indexer too) with
compress_rope_theta and YaRN.

Why an explicit softmax and not scaled_dot_product_attention: SDPA's formula has no sink logit (and its public
API returns no log-sum-exp to fold one in afterwards); CSA's keys differ per query (the indexer's picks), which
SDPA could take only as keys copied per query; and head_dim 512 is past the flash kernels' 256 (transformers'
DeepseekV4 runs eager-only for these reasons). So scores are computed here, on the paths an accelerator keeps
cheap: every mask is bool, applied in place (masked_fill_, never an added -inf tensor); queries are attended
in groups of equal length (paging.QueryGroup), so none is padded to a longer chunk; window and HCA rows are
read once per sequence and shared by its queries; pools are read one contiguous layer at a time (PoolIO).
On a GPU where Triton runs, that sparse flash attention is a kernel of this project's (attention_triton: per-query
row indices and the sink, rows read in place, no scores in memory). On an NPU it would be torch_npu's sparse
flash-attention op with per-query indices and a sink (what DeepSeek V3.2's sparse attention runs on Ascend); this
runner calls none there: no such kernel could be checked here.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from appliance.core.archs.deepseek_v4.layout import MTP_WINDOW_GROUP, DeepseekV4Layout
from npu.deepseek_v4.attention_triton import KeyRows, sparse_attention
from npu.deepseek_v4.hyper import unweighted_rms
from npu.deepseek_v4.indexer_triton import index_scores, pool_values
from npu.deepseek_v4.norms_triton import norm_kernel_applies, rms_norm_op
from npu.deepseek_v4.paging import Compression, PoolIO, QueryGroup, Rows, StepPlan
from npu.deepseek_v4.rope import Rope, Rotation


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with a float32 gain, computed in float32 and cast back once (as released); one launch on a GPU
    (npu.deepseek_v4.norms_triton)."""
    if norm_kernel_applies(x.device):
        return rms_norm_op(x, weight, eps)
    xf = x.float()
    return (weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def pool_windows(rows: torch.Tensor, ok: torch.Tensor, ratio: int, width: int, overlap: bool,
                 dtype: torch.dtype) -> torch.Tensor:
    """Compressed rows [J, width] from the state rows of each completed window [J, span, 2 coff width]
    ([kv | score], coff = 2 with overlap): sum over tokens of softmax(score) x kv, per channel. With overlap
    the span is the previous window then this one, and a row pools the previous window's first halves
    with this window's second halves; rows that do not exist (ok False: window -1) get no weight."""
    coff = 2 if overlap else 1
    kv, score = rows.split(coff * width, dim=-1)
    if overlap:
        kv = torch.cat([kv[:, :ratio, :width], kv[:, ratio:, width:]], dim=1)
        score = torch.cat([score[:, :ratio, :width], score[:, ratio:, width:]], dim=1)
    score = score.masked_fill(~ok[..., None], float("-inf"))
    return (kv.to(dtype) * score.softmax(dim=1).to(dtype)).sum(dim=1)


class Attention:
    """The attention sub-layer; weights come from `w(name)` (dense, in the compute dtype) and projections from
    `linear(x, name)` (x W^T, which may read a quantized W as stored) and `grouped_linear(x, name)` (x [n, G, in],
    each group through its block of rows of W: wo_a)."""

    def __init__(self, layout: DeepseekV4Layout, ratios: tuple[int, ...], kinds: dict[int, Compression],
                 ropes: dict[bool, Rope], w: Callable[[str], torch.Tensor],
                 linear: Callable[[torch.Tensor, str], torch.Tensor],
                 grouped_linear: Callable[[torch.Tensor, str], torch.Tensor], io: PoolIO, dtype: torch.dtype,
                 in_place: bool = False):
        self.lay, self.ratios, self.kinds, self.ropes, self.w, self.io, self.dtype = (
            layout, ratios, kinds, ropes, w, io, dtype)
        self.linear, self.grouped_linear = linear, grouped_linear
        self.csa = min(kinds)
        # On a GPU where Triton runs: the keys read in place by one kernel (npu.deepseek_v4.attention_triton) instead
        # of PoolIO.read + _attend, for parts whose pools hold plain values.
        self.in_place = in_place

    def rotations(self, plan: StepPlan) -> dict[object, Rotation]:
        """The step's rotations, computed once: at the tokens' positions (window-only and compressed RoPE) and
        at the first position of each window compressed in this step."""
        out: dict[object, Rotation] = {compressed: rope.at(plan.pos) for compressed, rope in self.ropes.items()}
        out.update({ratio: self.ropes[True].at(pos) for ratio, pos in plan.run_pos.items()})
        return out

    def window_group(self, layer: int) -> str:
        """The group of a layer's sliding-window rows: `ori` for main layers, the MTP layers' own group after them."""
        return "ori" if layer < len(self.ratios) else MTP_WINDOW_GROUP

    def __call__(self, layer: int, x: torch.Tensor, plan: StepPlan, rot: dict[object, Rotation],
                 prefix: str | None = None) -> torch.Tensor:
        """Layer `layer` (main layers, then MTP layers: window only) whose weights are under `prefix`
        (default `layers.L.`)."""
        lay, w = self.lay, self.w
        p = (prefix or f"layers.{layer}.") + "attn."
        ratio = self.ratios[layer] if layer < len(self.ratios) else 0
        d, eps = lay.head_dim, lay.rms_norm_eps
        rope = rot[bool(ratio)]
        q_latent = rms_norm(self.linear(x, p + "wq_a.weight"), w(p + "q_norm.weight"), eps)
        q = unweighted_rms(self.linear(q_latent, p + "wq_b.weight").view(-1, lay.num_heads, d), eps)
        q = rope.apply(q)
        kv = rope.apply(rms_norm(self.linear(x, p + "wkv.weight"), w(p + "kv_norm.weight"), eps))
        self.io.write(self.window_group(layer), layer, plan.rows["ori.write"], kv)
        if ratio:
            kind = self.kinds[ratio]
            self._compress(layer, p + "compressor.", kind, kind.states[0], kind.outputs[0], d, x, plan, rot[ratio])
            if ratio == self.csa:
                self._compress(layer, p + "indexer.compressor.", kind, kind.states[1], kind.outputs[1],
                               lay.index_head_dim, x, plan, rot[ratio])
        index = self._index_queries(layer, x, q_latent, rope) if ratio == self.csa else None
        outs = [self._attend_group(p, layer, ratio, group, q, index).flatten(0, 1)
                for group in plan.groups]                                   # [S * Q, H, d] each, in flat order
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        out = rope.apply(out, inverse=True)
        grouped = self.grouped_linear(out.reshape(out.shape[0], lay.o_groups, -1), p + "wo_a.weight")   # [n, G, rank]
        return self.linear(grouped.flatten(1), p + "wo_b.weight")

    def _compress(self, layer: int, prefix: str, kind: Compression, state: str, out: str, width: int,
                  x: torch.Tensor, plan: StepPlan, rope: Rotation) -> None:
        """Write this step's state rows; compress every window completed in this step into `out`."""
        w, r = self.w, kind.ratio
        kv = self.linear(x, prefix + "wkv.weight")
        score = self.linear(x, prefix + "wgate.weight").float() + w(prefix + "ape")[plan.pos % r]
        self.io.write(state, layer, plan.rows[f"{state}.write"], torch.cat([kv.float(), score], -1))
        read = plan.rows[f"{state}.read"]
        if read.page.numel() == 0:
            return
        coff = 2 if kind.overlap else 1
        rows = self.io.read(state, layer, read, 2 * coff * width, torch.float32)   # [J, coff r, 2 coff width]
        pooled = pool_windows(rows, read.ok, r, width, kind.overlap, self.dtype)
        pooled = rms_norm(pooled, w(prefix + "norm.weight"), self.lay.rms_norm_eps)
        self.io.write(out, layer, plan.rows[f"{out}.write"], rope.apply(pooled))

    def _attend_group(self, prefix: str, layer: int, ratio: int, group: QueryGroup, q: torch.Tensor,
                      index: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """One query group's attention, [S, Q, H, d]: its keys read in place by the kernel, or read out and _attend."""
        parts = self._key_rows(layer, ratio, group, index)
        if self.in_place and not any(self.io.scaled(name) for name, _, _ in parts):
            # each mask only admits rows that exist (rows.ok): the window's includes its validity, a compressed row
            # is visible only once its window has ended, the indexer's picks are masked by their ok
            return sparse_attention(group.view(q), self.w(prefix + "attn_sink"),
                                    [KeyRows(self.io.layer_pool(name, layer), rows.page, rows.row, mask)
                                     for name, rows, mask in parts])
        d = self.lay.head_dim
        return self._attend(prefix, group.view(q), [(self.io.read(name, layer, rows, d, self.dtype), mask)
                                                    for name, rows, mask in parts])

    def _key_rows(self, layer: int, ratio: int, group: QueryGroup,
                  index: tuple[torch.Tensor, torch.Tensor] | None) -> list[tuple[str, Rows, torch.Tensor]]:
        """The key parts of one query group, each (cache group, rows, bool mask [S, Q, K]): the window rows; HCA:
        every compressed row, masked to those visible; CSA: the rows the indexer picks for each query."""
        parts = [(self.window_group(layer), group.keys["ori"], group.window_mask)]
        if ratio:
            cmp = self.kinds[ratio].outputs[0]
            if ratio != self.csa:
                parts.append((cmp, group.keys[cmp], group.visible[ratio]))
            elif index is not None and (picked := self._index(layer, group, *index)) is not None:   # CSA: set
                parts.append((cmp, picked, picked.ok))
        return parts

    def _index_queries(self, layer: int, x: torch.Tensor, q_latent: torch.Tensor,
                       rope: Rotation) -> tuple[torch.Tensor, torch.Tensor]:
        """The lightning indexer's per-token queries [N, heads, di] and head weights [N, heads]."""
        lay = self.lay
        p, heads, di = f"layers.{layer}.attn.indexer.", lay.index_num_heads, lay.index_head_dim
        q = rope.apply(self.linear(q_latent, p + "wq_b.weight").view(-1, heads, di))
        return q, self.linear(x, p + "weights_proj.weight").float() * heads ** -0.5

    def _index(self, layer: int, group: QueryGroup, q: torch.Tensor, head_w: torch.Tensor) -> Rows | None:
        """Rows of the top index_topk visible CSA rows of each query of the group, [S, Q, k].

        Ties (rows scoring exactly alike: every head's relu is 0) are broken as transformers breaks them: by
        torch.topk over the same row of scores, a sequence's compressed rows 0 .. T - 1 with the invisible ones
        at -inf, T = the query's ranked_end // ratio (paging.QueryGroup: what a one-step prefill of the prompt,
        then one decode token per step, ranks over). torch.topk's choice among equal values depends on the row's
        length and values only (not on batching), so chunking, batching and preemption never change it. One call
        ranks the whole group; where a query's k-th and (k + 1)-th scores tie, its picks are taken from one call
        per ranked length T instead (which queries rank over which T is host-known: paging.IndexPlan), chosen on
        the device with torch.where, so no host sync decides anything."""
        di, ratio, plan = self.lay.index_head_dim, self.csa, group.index
        if plan is None or plan.k == 0:
            return None
        k, width = plan.k, plan.width
        visible = group.visible[ratio]
        pool = self.io.layer_pool("idx", layer)
        values = pool_values(pool, self.io.scaled("idx")) if self.in_place else None
        if values is not None:                   # one kernel reading the rows in place (npu.deepseek_v4.indexer_triton)
            rows = group.keys["idx"]
            score = index_scores(group.view(q), group.view(head_w), pool, rows.page, rows.row, visible, width, values,
                                 self.io.model.group("idx").row_width)
        else:
            keys = self.io.read("idx", layer, group.keys["idx"], di, torch.float32)               # [S, Kc, di]
            dots = torch.einsum("sqhd,skd->sqhk", group.view(q).float(), keys).relu_().mul_(di ** -0.5)   # in place:
            score = dots.mul_(group.view(head_w)[..., None]).sum(dim=2)                # one [S, Q, heads, Kc] tensor
            del dots
            score = F.pad(score.masked_fill(~visible, float("-inf")), (0, width - score.shape[-1]),
                          value=float("-inf"))
        top = score.topk(min(k + 1, width), dim=-1)              # one call for the group: the k best of each query
        order = top.indices[..., :k].contiguous()                 # are the same set under any tie rule unless the
        if k < width and plan.by_length:                          # k-th and the (k + 1)-th score are equal
            kth = top.values[..., k - 1]
            tied = ((kth == top.values[..., k]) & (kth > float("-inf"))).flatten()               # [S * Q]
            flat_order, flat_score = order.view(-1, k), score.flatten(0, 1)
            for length, queries in plan.by_length:                # then: transformers' call, on the query's row
                alt = flat_score.index_select(0, queries)[:, :length].topk(k, dim=-1).indices
                now = flat_order.index_select(0, queries)
                flat_order.index_copy_(0, queries, torch.where(tied.index_select(0, queries)[:, None], alt, now))
        ok = score.gather(-1, order) > float("-inf")
        where = group.keys[self.kinds[ratio].outputs[0]]                                   # [S, Kc]
        inside = order.clamp(max=where.page.shape[1] - 1)                  # rows past Kc are -inf: not ok
        pick = lambda t: t.gather(1, inside.flatten(1)).view_as(order)  # noqa: E731
        return Rows(pick(where.page), pick(where.row), ok)

    def _attend(self, prefix: str, q: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """q [S, Q, H, d] over parts of keys = values with masks [S, Q, K]: keys [S, K, d] are shared by a
        sequence's queries, keys [S, Q, K, d] are per query. One softmax over all parts and a sink logit."""
        S, Q, H, d = q.shape
        scores = []
        for keys, mask in parts:       # scaled and masked in place: one [S, H, Q, K] float32 tensor per part
            eq = "sqhd,skd->shqk" if keys.dim() == 3 else "sqhd,sqkd->shqk"
            scores.append(torch.einsum(eq, q, keys).float().mul_(d ** -0.5).masked_fill_(~mask[:, None], -math.inf))
        widths = [s.shape[-1] for s in scores]
        sink = self.w(prefix + "attn_sink").float().view(1, H, 1, 1).expand(S, H, Q, 1)
        logits = torch.cat([*scores, sink], dim=-1)
        scores.clear()                 # the parts go before the softmax allocates its output
        probs = logits.softmax(dim=-1)
        del logits
        out = torch.zeros_like(q)
        for (keys, _), prob in zip(parts, probs[..., :-1].split(widths, dim=-1), strict=True):
            eq = "shqk,skd->sqhd" if keys.dim() == 3 else "shqk,sqkd->sqhd"
            out = out + torch.einsum(eq, prob.to(keys.dtype), keys)
        return out
