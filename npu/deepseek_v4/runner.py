"""DeepSeek V4 (as released: DeepSeek-V4-Flash) over the seven paged KV-cache groups, the tiny and the full layout.

Per main layer, on hc_mult residual streams (npu/deepseek_v4/hyper.py):
    post, comb, x = hc_pre(streams); streams = post * attention(attn_norm(x)) + comb^T streams
    post, comb, x = hc_pre(streams); streams = post * moe(ffn_norm(x)) + comb^T streams
then logits = head(norm(hc_head(streams))). Attention (npu/deepseek_v4/attention.py): q-LoRA queries, one shared
KV row, a sliding window (`ori`), compressed rows (overlapping CSA with the lightning indexer, HCA), a
learned sink, grouped output projection. MoE (npu/deepseek_v4/moe.py): routed experts (the first num_hash_layers
layers route by tid2eid[token]) plus a shared expert. The oracle is transformers' DeepseekV4ForCausalLM on
the same weights (tests/npu/test_dsv4_oracle.py).

Weights: the tensors and names of the released checkpoint (appliance/core/archs/deepseek_v4/weights.py).
They are held as stored: FP8 / FP4 matrices stay quantized on the device. On a CPU each is dequantized to the
compute dtype when its layer runs (a routed expert only when some token picks it); on a GPU with Triton the
routed experts (stacked per layer) and the FP8 linears are read as stored by npu.grouped_gemm_triton, which
dequantizes tile by tile inside the kernel; elsewhere a layer's stack is dequantized for the step. The model is
never in the compute dtype all at once. MTP layers (`mtp.J.*`) are loaded, checked and held the same way under
their released names (self.params), but not run: a speculative-decoding drafter can read them there.

Steps may start anywhere and hold up to tokens_in_flight tokens per sequence, as long as every
compressor-state ring has a slot for each page the step touches (block-aligned chunks always do; see
appliance.core.archs.deepseek_v4.cache_groups.state_span_pages). Nothing bakes in a pool size: rows are located through
the step's block tables on the runtime pools.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from appliance.core.archs.deepseek_v4.layout import MTP_WINDOW_GROUP, STATE_GROUPS, compress_ratios
from appliance.core.archs.deepseek_v4.weights import checkpoint_tensors, rank_weights, scale_name, stored_tensors
from appliance.core.config import ModelSpec
from appliance.core.errors import CheckpointError
from appliance.core.parallel import RankPlace, TensorSlice, split
from npu.deepseek_v4.attention import Attention, rms_norm
from npu.deepseek_v4.attention_triton import sparse_attention_applies
from npu.deepseek_v4.expert_stacks import Held, stack_experts
from npu.deepseek_v4.hyper import hc_head, hc_post, hc_pre
from npu.deepseek_v4.moe import (
    FIXED_EXCHANGE_PAIRS,
    GroupedGemm,
    by_expert,
    exchange_experts,
    exchange_experts_fixed,
    expert_exchange_mode,
    expert_gemm,
    grouped_experts,
    grouped_pairs,
    route,
    routed_experts,
    swiglu,
)
from npu.deepseek_v4.mtp import STALE_STEPS, Fed, MtpHistory, catch_up_rows, feed_tokens, flat_starts
from npu.deepseek_v4.paging import Compression, PoolIO, StepPlan, build_plan, flat_order
from npu.deepseek_v4.rope import Rotation, layer_ropes
from npu.deepseek_v4.sinkhorn_cpu import cpu_sinkhorn_for
from npu.deepseek_v4.sinkhorn_triton import sinkhorn_for
from npu.grouped_gemm_triton import grouped_gemm_applies, triton_grouped_linear, triton_linear
from npu.quant import QuantizedWeight
from npu.runner import ModelRunner
from npu.step import SeqStep, StepBatch
from npu.weights import is_norm_weight, random_seed


class DeepseekV4Runner(ModelRunner):
    """DeepSeek V4 over paged caches: sliding window (ori), CSA (cmp_c{small}, idx) and HCA (cmp_c{large})."""

    feeds_tokens = True

    def __init__(self, model: ModelSpec, device: torch.device | str, place: RankPlace | None = None):
        super().__init__(model, torch.device(device), place)
        lay = model.layout
        self.ratios = model.main_layer_ratios
        ratios = compress_ratios(lay)
        if ratios is None:                        # the arch rules (run by ModelRunner) refuse such a layout first
            raise ValueError(f"model.layout.compress_ratios {list(lay.compress_ratios)}: needs exactly two nonzero")
        self.csa_ratio, self.hca_ratio = ratios
        self.dtype = getattr(torch, lay.dtype)
        self.kinds = {
            self.csa_ratio: Compression(self.csa_ratio, ("csa_state", "csa_inner_state"),
                                        (f"cmp_c{self.csa_ratio}", "idx"), overlap=True),
            self.hca_ratio: Compression(self.hca_ratio, ("hca_state",), (f"cmp_c{self.hca_ratio}",), overlap=False),
        }
        self.state_groups = STATE_GROUPS          # zeroed by zero_new_pages whenever a step announces a page
        # The MTP window can read a row its layer never wrote as a valid one (a prefix hit on a prompt that ended with
        # its prefill: its last MTP row waited for a next token): zeroed on first use, as a zeroed pool had it. Every
        # other group reads rows never written only under torch.where (paging.PoolIO.read): never cleared.
        self.zero_on_first_use = frozenset({MTP_WINDOW_GROUP})
        # Speculative decoding: the MTP layer's window group exists only with speculative.method=mtp.
        self.drafts = any(g.name == MTP_WINDOW_GROUP for g in model.cache_groups)
        self.mtp_history: dict[str, MtpHistory] = {}
        self.executed_steps = 0
        self.params: dict[str, Held] = {}
        # On an accelerator: each MoE layer's routed experts stacked (w1, w3, w2 of [E, ...]), by "layers.L.ffn." /
        # "mtp.0.ffn.", held as stored and run by moe.grouped_experts (no host sync) through expert_gemm, the
        # device's grouped GEMM (FP4 / FP8 stacks read as stored where Triton runs).
        # With expert parallel the stacks hold this rank's experts (global ids lo..hi), and the exchange with the other
        # ranks is the fixed-shape one (moe.exchange_experts_fixed: no host sync) for steps of at most
        # FIXED_EXCHANGE_PAIRS pairs, else by counts (moe.EXPERT_EXCHANGE_ENV overrides).
        self.expert_stacks: dict[str, tuple[Held, Held, Held]] = {}
        self.expert_gemm: GroupedGemm | None = None
        self.expert_exchange = expert_exchange_mode()
        self.exchange_rows = 0                    # this step's StepBatch.expert_rows
        # On an accelerator where Triton runs: FP8 linears read as stored by the same kernel (one group), never
        # dequantized whole (self.linear).
        self.linears_as_stored = False
        # ... and wo_a, whose o_groups row blocks each project one group of heads, as a stack of those matrices by
        # the weight's name (QuantizedWeight.row_blocks; None where its scale blocks straddle two row blocks: then
        # dequantized for the step).
        self.row_blocks: dict[str, QuantizedWeight | None] = {}
        # The hyper-connections' Sinkhorn normalization: one Triton launch per hc_pre on a GPU instead of 78
        # (npu.deepseek_v4.sinkhorn_triton), one C++ call on a CPU (npu.deepseek_v4.sinkhorn_cpu), both the bits of
        # torch's ops, which run elsewhere.
        self.sinkhorn = cpu_sinkhorn_for(self.device, lay.hc_mult) or sinkhorn_for(self.device, lay.hc_mult)
        self.io = PoolIO(model, self.pools)
        # Attention's keys read in place by one Triton kernel on a GPU (npu.deepseek_v4.attention_triton).
        in_place = self.device.type == "cuda" and sparse_attention_applies(self.device, self.dtype, lay.head_dim)
        self.attention = Attention(lay, self.ratios, self.kinds, layer_ropes(lay, self.device, self.dtype),
                                   self.weight, self.linear, self.grouped_linear, self.io, self.dtype, in_place)

    # -- weights -----------------------------------------------------------------------------------
    def expected_weights(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {t.name: (t.shape, getattr(torch, t.dtype)) for t in checkpoint_tensors(self.model.layout)}

    def held_weights(self) -> dict[str, TensorSlice | None]:
        """Expert parallel: the replicated weights and this rank's routed experts, each whole."""
        lay = self.model.layout
        return {t.name: None for w in rank_weights(lay, self.place) for t in stored_tensors(w, lay)}

    def random_weights(self, seed: int, std: float = 0.02, device: torch.device | str | None = None
                       ) -> dict[str, torch.Tensor]:
        """Seeded random weights whose hash-routing tables name distinct valid experts per token."""
        state = super().random_weights(seed, std, device)
        lay = self.model.layout
        for name, table in state.items():
            if name.endswith(".tid2eid") and table.device.type != "meta":     # made where it lives, as the rest
                gen = torch.Generator(device=table.device).manual_seed(random_seed(seed, name))
                picks = torch.rand(lay.vocab_size, lay.num_experts, generator=gen, device=table.device).argsort(dim=-1)
                state[name] = picks[:, :lay.num_experts_per_tok].to(table.dtype)
        return state

    def install_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Hold quantized matrices as QuantizedWeight (values + scales), norm gains and float32 tensors in
        float32, routing tables as indices, everything else as loaded (the compute dtype)."""
        lay, held = self.model.layout, dict[str, Held]()
        for w in rank_weights(lay, self.place):
            t = weights[w.name]
            if w.format in ("fp8", "fp4"):
                scale = weights[scale_name(w.name)]
                held[w.name] = QuantizedWeight(w.name, t, scale, lay.quant_block_size or 0).check()
            elif w.format == "int32":
                held[w.name] = t.long()
                if t.device.type != "meta" and t.numel() and not 0 <= int(t.min()) <= int(t.max()) < lay.num_experts:
                    raise CheckpointError(f"{w.name}: expert ids {int(t.min())}..{int(t.max())} outside "
                                          f"[0, {lay.num_experts}) (model.layout.num_experts)")
            elif w.format == "float32" or is_norm_weight(w.name):
                held[w.name] = t.float()
            else:
                held[w.name] = t
        self.expert_stacks = {}
        if self.device.type != "cpu" or (self.place.expert > 1 and self.expert_exchange == "fixed"):
            self.expert_stacks = stack_experts(held)            # routed experts as one grouped GEMM per layer
            self.expert_gemm = expert_gemm(self.device, self.dtype)
        self.params = held
        self.linears_as_stored, self.row_blocks = False, {}
        if self.device.type != "cpu" and grouped_gemm_applies(self.device, self.dtype):
            self.read_linears_as_stored()

    def read_linears_as_stored(self) -> None:
        """From now on the quantized linears run through the grouped kernel as stored (self.linear), and each wo_a
        as its o_groups row blocks (self.grouped_linear): what install_weights picks where Triton runs."""
        self.linears_as_stored = True
        self.row_blocks = {name: w.row_blocks(self.model.layout.o_groups) for name, w in self.params.items()
                           if name.endswith("attn.wo_a.weight") and isinstance(w, QuantizedWeight)}

    def weight_tensors(self) -> list[torch.Tensor]:
        held = [*self.params.values(), *(w for stack in self.expert_stacks.values() for w in stack),
                *(b for b in self.row_blocks.values() if b is not None)]     # their values are views: counted once
        return [t for w in held for t in ((w.values, w.scale) if isinstance(w, QuantizedWeight) else (w,))]

    def weight(self, name: str) -> torch.Tensor:
        """A weight for the math: quantized matrices dequantized to the compute dtype now, others as held."""
        w = self.params[name]
        return w.dequantize(self.dtype) if isinstance(w, QuantizedWeight) else w

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x W^T for the weight `name`: a quantized matrix read as stored by the grouped kernel where it runs
        (linears_as_stored), else the weight as self.weight gives it."""
        w = self.params[name]
        if self.linears_as_stored and isinstance(w, QuantizedWeight):
            return triton_linear(x, w)
        return F.linear(x, self.weight(name))

    def grouped_linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x [n, G, in] -> [n, G, out]: group g through row block g of the weight `name` ([G * out, in]). Where
        linears are read as stored, a quantized weight goes to the grouped kernel as its G row blocks (one launch,
        nothing dequantized); else the weight as self.weight gives it, in one batched matmul."""
        blocks = self.row_blocks.get(name)
        if blocks is not None:
            return triton_grouped_linear(x, blocks)
        return torch.einsum("ngi,gri->ngr", x, self.weight(name).view(x.shape[1], -1, x.shape[-1]))

    # -- model -------------------------------------------------------------------------------------
    def _moe(self, layer: int, x: torch.Tensor, token_ids: torch.Tensor, worst_case: bool,
             prefix: str | None = None) -> torch.Tensor:
        """Routed experts plus the shared one. worst_case (a profiling step): every token routes to the same
        num_experts_per_tok experts, the routing whose expert activations are largest (an expert computes
        all N tokens at once; a uniform routing gives each about N k / num_experts)."""
        lay, w, p = self.model.layout, self.weight, (prefix or f"layers.{layer}.") + "ffn."
        hashed = layer < lay.num_hash_layers
        table, ids = (w(p + "gate.tid2eid"), token_ids) if hashed else (None, None)
        if worst_case:
            table = torch.arange(lay.num_experts_per_tok, device=x.device)[None]
            ids = torch.zeros_like(token_ids)
        weights, experts = route(x, w(p + "gate.weight"), lay.scoring_func, lay.num_experts_per_tok,
                                 lay.routed_scaling_factor, bias=None if hashed else w(p + "gate.bias"),
                                 table=table, token_ids=ids)

        def expert(e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return w(f"{p}experts.{e}.w1.weight"), w(f"{p}experts.{e}.w3.weight"), w(f"{p}experts.{e}.w2.weight")

        if self.expert_parallel is not None:
            routed = self._exchange(p, x, weights, experts, expert)
        elif p in self.expert_stacks and self.expert_gemm is not None:
            routed = grouped_experts(x, weights, experts, *self.expert_stacks[p], lay.swiglu_limit, self.expert_gemm)
        else:
            routed = routed_experts(x, weights, experts, expert, lay.swiglu_limit)
        shared = swiglu(x, f"{p}shared_experts.w1.weight", f"{p}shared_experts.w3.weight",
                        f"{p}shared_experts.w2.weight", lay.swiglu_limit, self.linear)
        return routed + shared

    def _exchange(self, p: str, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                  expert: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The routed experts of MoE layer p over the expert-parallel ranks: with this rank's experts stacked, the
        fixed-shape exchange where the step's bound allows it (every rank decides alike: the bound and the mode are
        the same on each), else the exchange by counts with the stacks as one grouped GEMM; without stacks (a CPU),
        by counts with each picked expert run on its rows."""
        group, lay = self.expert_parallel, self.model.layout
        assert group is not None
        stacks, gemm, limit = self.expert_stacks.get(p), self.expert_gemm, lay.swiglu_limit
        if stacks is None or gemm is None:
            return exchange_experts(group, x, weights, experts, lambda rows, ids: by_expert(rows, ids, expert, limit),
                                    lay.num_experts)
        fixed = self.exchange_rows > 0 and (self.expert_exchange == "fixed" or (
            self.expert_exchange == "auto" and group.size * self.exchange_rows * experts.shape[1] <= FIXED_EXCHANGE_PAIRS))
        if fixed:
            return exchange_experts_fixed(group, x, weights, experts, *stacks, limit, gemm, lay.num_experts,
                                          self.exchange_rows)
        lo, held = split(lay.num_experts, group.size, group.rank)[0], stacks[0].shape[0]
        return exchange_experts(group, x, weights, experts,
                                lambda rows, ids: grouped_pairs(rows, ids - lo, 1, held, *stacks, limit, gemm),
                                lay.num_experts)

    def _hc(self, prefix: str, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lay = self.model.layout
        return hc_pre(streams, self.weight(prefix + "_fn"), self.weight(prefix + "_base"),
                      self.weight(prefix + "_scale"), lay.hc_sinkhorn_iters, lay.hc_eps, lay.rms_norm_eps,
                      self.sinkhorn)

    def _block(self, layer: int, streams: torch.Tensor, plan: StepPlan, rot: dict[object, Rotation],
               worst_case: bool, prefix: str | None = None) -> torch.Tensor:
        """Decoder layer `layer` (main layers, then MTP layers) with its weights under prefix (`layers.L.`)."""
        p, eps = prefix or f"layers.{layer}.", self.model.layout.rms_norm_eps
        post, comb, x = self._hc(p + "hc_attn", streams)
        out = self.attention(layer, rms_norm(x, self.weight(p + "attn_norm.weight"), eps), plan, rot, p)
        streams = hc_post(out, streams, post, comb)
        post, comb, x = self._hc(p + "hc_ffn", streams)
        out = self._moe(layer, rms_norm(x, self.weight(p + "ffn_norm.weight"), eps), plan.token_ids, worst_case, p)
        return hc_post(out, streams, post, comb)

    # -- steps -------------------------------------------------------------------------------------
    def prepare(self, batch: StepBatch) -> StepBatch:
        """The host checks of a step. DeepSeek V4 lays out its step inside forward, from host data only (build_plan,
        then one upload per plan), because drafting plans each MTP pass after the last: a draft's value stays on the
        device and is written into the next plan's tokens there (feed_tokens)."""
        if not self.params:
            raise RuntimeError("DeepseekV4Runner.execute: no weights; call load_weights() or set_weights() first")
        if not self.pools:
            raise RuntimeError("DeepseekV4Runner.execute: no pools; call allocate_pools() first")
        return batch

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """One step under inference mode (as Qwen3Runner.forward): the model is hundreds of tiny ops per layer,
        and no_grad still pays autograd's per-op bookkeeping (about 15% of a tiny-model decode step)."""
        lay = self.model.layout
        self.exchange_rows = batch.expert_rows
        if not batch.seqs:
            if self.expert_parallel is not None:
                self._serve_experts_only(batch.draft_passes)
            return torch.empty(0, lay.vocab_size, dtype=torch.float32, device=self.device)
        self.executed_steps += 1
        seqs, fed, drafted, drafts = batch.seqs, Fed(), list[torch.Tensor](), dict[str, torch.Tensor]()
        passes = max([batch.draft_passes, *(s.num_draft for s in seqs)])
        if passes:
            seqs, fed, drafted, drafts = self._draft(seqs, passes, batch.worst_case)
        plan = build_plan(self.model, StepBatch(seqs, batch.new_pages, batch.worst_case), list(self.kinds.values()),
                          self.device)
        feed_tokens(plan, seqs, fed)
        if batch.fed is not None:              # async scheduling (never with drafts: seqs are the batch's)
            starts = flat_starts(seqs)
            self.feed_rows(plan.token_ids, [starts[i] for i, _ in batch.fed.rows], batch.fed)
        x = self.weight("embed.weight")[plan.token_ids]
        streams = x.unsqueeze(1).expand(-1, lay.hc_mult, -1).contiguous()
        rot = self.attention.rotations(plan)
        for layer in range(len(self.ratios)):
            streams = self._block(layer, streams, plan, rot, batch.worst_case)
        logits = self._head(streams[plan.sample_index], "", "norm.weight")
        if self.drafts:
            self._remember(batch.seqs, seqs, streams, batch.worst_case, drafts)
        return torch.cat([logits, *drafted]) if drafted else logits

    def _head(self, streams: torch.Tensor, hc_prefix: str, norm: str) -> torch.Tensor:
        """Logits (float32) of final streams [N, hc, D]: hc_head, norm, the shared head."""
        lay, w = self.model.layout, self.weight
        last = hc_head(streams, w(hc_prefix + "hc_head_fn"), w(hc_prefix + "hc_head_base"),
                       w(hc_prefix + "hc_head_scale"), lay.hc_eps, lay.rms_norm_eps)
        last = rms_norm(last, w(norm), lay.rms_norm_eps)
        head = w("embed.weight" if lay.tie_word_embeddings else "head.weight")
        return torch.nn.functional.linear(last, head).float()

    # -- MTP drafting (npu/deepseek_v4/mtp.py) ----------------------------------------------------------------
    def _mtp_pass(self, seqs: list[SeqStep], hidden: list[torch.Tensor], worst_case: bool,
                  fed: Fed | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The first MTP layer over `seqs` (rows i with their next tokens, as SeqSteps from row start_pos; `fed`: the
        tokens only the device knows, see _feed) and the main streams at those rows (hidden[k]:
        [len(seqs[k].token_ids), hc, D]); (logits, output streams) of each sequence's last row, in order. Later MTP
        layers are not run: the first one chains (as vLLM does)."""
        lay, w, p = self.model.layout, self.weight, "mtp.0."
        if not seqs:                                    # nothing of this rank's: still serve the expert exchange
            self._mtp_experts_only()
            return torch.empty(0, lay.vocab_size, device=self.device), torch.empty(0, device=self.device)
        plan = build_plan(self.model, StepBatch(seqs, worst_case=worst_case), [], self.device,
                          window=MTP_WINDOW_GROUP)
        feed_tokens(plan, seqs, fed or {})
        h = torch.cat([hidden[i] for i in flat_order(seqs)])
        e = rms_norm(w("embed.weight")[plan.token_ids], w(p + "enorm.weight"), lay.rms_norm_eps)
        x = (self.linear(e, p + "e_proj.weight").unsqueeze(1)
             + self.linear(rms_norm(h, w(p + "hnorm.weight"), lay.rms_norm_eps), p + "h_proj.weight"))
        streams = self._block(lay.num_layers, x, plan, self.attention.rotations(plan), worst_case, p)
        last = streams[plan.sample_index]
        return self._head(last, p, p + "norm.weight"), last

    def _draft(self, seqs: list[SeqStep], passes: int, worst_case: bool
               ) -> tuple[list[SeqStep], Fed, list[torch.Tensor], dict[str, torch.Tensor]]:
        """Each verifying row's drafts: the MTP layer catches up on the row's committed tokens (its last row
        drafts the first token), then chains one row per further draft. A draft is the argmax of its row, taken on
        the device and fed to the next pass and to the verify rows there (no host sync). Returns the step's rows
        with placeholder drafts appended (verified with every position's logits), the drafts to feed into them,
        the drafter's logits of each drafting row [num_draft, vocab] in batch order, and each row's drafts by
        request id (its MTP history keeps them)."""
        lay = self.model.layout
        spec = [s for s in seqs if s.num_draft]
        zero = lambda n: torch.zeros(n, lay.hc_mult, lay.hidden_size, dtype=self.dtype, device=self.device)  # noqa: E731
        rows, hidden, fed = list[SeqStep](), list[torch.Tensor](), Fed()
        for j, s in enumerate(spec):
            if len(s.token_ids) != 1:
                raise ValueError(f"request {s.request_id!r}: a verifying row computes one token and its drafts, "
                                 f"got {len(s.token_ids)} tokens")
            history = self.mtp_history.get(s.request_id)
            catch = catch_up_rows(history, s.start_pos, s.token_ids[0])
            if worst_case and s.start_pos > 0:              # the profile: the longest catch-up a real step has
                n = min(s.num_draft + 1, s.start_pos)
                first, tokens, h = s.start_pos - n, [0] * n, zero(n)
            elif catch is None or history is None:          # nothing held (a fresh history is written below)
                first, tokens, h = max(s.start_pos - 1, 0), [s.token_ids[0]], zero(1)
            else:
                first, tokens, h = catch.first, catch.tokens, history.hidden[catch.hidden[0]:catch.hidden[1]]
                if catch.fed is not None:
                    fed[j] = catch.fed
            rows.append(SeqStep(s.request_id, tokens, first, s.block_tables))
            hidden.append(h)
        drafts: list[list[torch.Tensor]] = [[] for _ in spec]
        logits: list[list[torch.Tensor]] = [[] for _ in spec]
        for k in range(passes):
            live = [i for i, s in enumerate(spec) if s.num_draft > k]
            out, last = self._mtp_pass([rows[i] for i in live], [hidden[i] for i in live], worst_case,
                                       {n: fed[i] for n, i in enumerate(live) if i in fed})
            picked = out.argmax(dim=-1)                     # the drafts, on the device (first maximum on ties)
            fed = {}
            for n, i in enumerate(live):
                drafts[i].append(picked[n:n + 1])
                logits[i].append(out[n:n + 1])
                hidden[i] = last[n:n + 1]
                rows[i] = SeqStep(spec[i].request_id, [0], spec[i].start_pos + k, spec[i].block_tables)
                fed[i] = (0, picked[n:n + 1])
        verify = [s if not s.num_draft else
                  SeqStep(s.request_id, s.token_ids + [0] * s.num_draft, s.start_pos, s.block_tables,
                          prompt_len=s.prompt_len, all_logits=True) for s in seqs]
        row_drafts = {s.request_id: torch.cat(drafts[j]) for j, s in enumerate(spec)}
        verify_fed = {i: (1, row_drafts[s.request_id]) for i, s in enumerate(seqs) if s.num_draft}
        return verify, verify_fed, [torch.cat(logits[j]) for j in range(len(spec))], row_drafts

    def _remember(self, asked: list[SeqStep], ran: list[SeqStep], streams: torch.Tensor, worst_case: bool,
                  drafts: dict[str, torch.Tensor]) -> None:
        """Keep each sequence's final main streams for its next drafting; a prefill chunk [s, e) first writes its
        MTP rows up to e - 2 (row s - 1 from the history, when held). A verifying row's history keeps its drafts
        as device tokens (MtpHistory.drafted)."""
        offsets = flat_starts(ran)
        rows, hidden, kept = [], [], []
        for i, (a, s) in enumerate(zip(asked, ran)):
            h = streams[offsets[i]:offsets[i] + len(s.token_ids)]
            if a.num_draft:
                self.mtp_history[s.request_id] = MtpHistory(s.start_pos, tuple(a.token_ids), h.clone(), s.start_pos,
                                                            self.executed_steps, drafts[s.request_id])
                continue
            history = self.mtp_history.get(s.request_id)
            before = history.hidden_at(s.start_pos - 1) if history is not None and not worst_case else None
            if before is not None and history is not None and history.mtp_next <= s.start_pos - 1:
                rows.append(SeqStep(s.request_id, list(s.token_ids), s.start_pos - 1, s.block_tables))
                hidden.append(torch.cat([before, h[:-1]]))
            elif len(s.token_ids) > 1:
                rows.append(SeqStep(s.request_id, list(s.token_ids[1:]), s.start_pos, s.block_tables))
                hidden.append(h[:-1])
            end = s.start_pos + len(s.token_ids)
            kept.append((s.request_id, MtpHistory(end - 1, (s.token_ids[-1],), h[-1:].clone(), end - 1, self.executed_steps)))
        if rows or self.expert_parallel is not None:        # every expert-parallel rank joins the pass
            self._mtp_pass(rows, hidden, worst_case)
        self.mtp_history.update(kept)
        if worst_case:
            self.mtp_history.clear()
        for rid in [r for r, hist in self.mtp_history.items() if hist.step < self.executed_steps - STALE_STEPS]:
            del self.mtp_history[rid]

    @torch.inference_mode()
    def _serve_experts_only(self, draft_passes: int = 0) -> None:
        """A step with no sequences on this rank: its routed experts still serve the other ranks' tokens, so it
        joins every layer's expert exchange with no tokens of its own (expert-parallel ranks step in lockstep),
        and with speculation the MTP layer's: each drafting pass, then the prefill catch-up pass."""
        x = torch.zeros(0, self.model.layout.hidden_size, dtype=self.dtype, device=self.device)
        no_tokens = torch.zeros(0, dtype=torch.long, device=self.device)
        for _ in range(draft_passes):
            self._mtp_experts_only()
        for layer in range(len(self.ratios)):
            self._moe(layer, x, no_tokens, worst_case=False)
        if self.drafts:
            self._mtp_experts_only()

    def _mtp_experts_only(self) -> None:
        """The MTP layer's expert exchange with no tokens of this rank's."""
        x = torch.zeros(0, self.model.layout.hidden_size, dtype=self.dtype, device=self.device)
        self._moe(self.model.layout.num_layers, x, torch.zeros(0, dtype=torch.long, device=self.device), False,
                  "mtp.0.")
