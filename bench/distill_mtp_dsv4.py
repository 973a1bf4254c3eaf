#!/usr/bin/env python3
"""Distill the tiny DeepSeek V4's MTP layer from its main model, then measure speculative decoding with it.

Random weights make the MTP layer propose tokens the main model never accepts, so speculation can only cost
there. This script builds a tiny checkpoint whose MTP layer has learnt to draft: a few CPU minutes.

1. The main model: the embedded tiny DeepSeek V4 (conf/model/dsv4_tiny.yaml) with seeded random weights (std
   --std; the defaults, seed 0 and std 0.02, are exactly the embedded default's weights), saved as a checkpoint
   with the released tensor names.
2. Data: greedy continuations of random prompts, served by the appliance itself; then every full sequence is
   prefilled once more with speculation on, which hands the MTP drafter the main model's final streams h_i at
   every position (recorded here), and with prompt logprobs, which give the main model's argmax at every
   position. A training row is (h_i, token i + 1) -> the main model's argmax at i + 1 (what row i drafts).
3. Training (Adam, cross-entropy on each row and on the row chained after it from its output streams, as
   drafts 2 and 3 are drafted): the MTP layer's input and output parts (e_proj, h_proj, enorm, hnorm, norm,
   hc_head_*). Its decoder block is switched off (wo_b and every expert's w2 zero: the block adds nothing, its
   hyper-connection mixing still runs), so the training forward is a few lines of torch that compute what the
   runner computes on those weights. The shared embedding and head stay the main model's.
4. Benchmark: greedy requests at batch 1, 8 and 32, without speculation and with K = 1..3 drafts per row:
   tokens per engine step, tokens per verifying row, acceptance by position, output tok/s.

Usage (from the repository root):
    PYTHONPATH=$PWD python bench/distill_mtp_dsv4.py OUT_DIR [--sequences 96] [--steps 400] [--bench-only]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from appliance.config.compose import load_runtime_config
from appliance.core.request import SamplingParams
from appliance.offline import Appliance
from npu.deepseek_v4.attention import rms_norm
from npu.deepseek_v4.hyper import hc_head, hc_post, hc_pre
from npu.deepseek_v4.paging import flat_order
from npu.deepseek_v4.runner import DeepseekV4Runner
from tests.support.checkpoints import save_checkpoint

BASE = ["+model=dsv4_tiny", "device=cpu", "device.cpu_threads=1", "max_model_len=256", "max_num_batched_tokens=256"]
TRAINED = ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight", "hc_head_fn",
           "hc_head_base", "hc_head_scale")


def main_model_checkpoint(out: Path, seed: int, std: float) -> dict[str, torch.Tensor]:
    model = load_runtime_config(BASE).model
    state = DeepseekV4Runner(model, torch.device("cpu")).random_weights(seed, std, device="cpu")
    save_checkpoint(out, model, state)
    return state


def prompts(n: int, seed: int, lo: int = 8, hi: int = 96) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def collect(directory: Path, work: list[list[int]], new_tokens: int) -> tuple[torch.Tensor, ...]:
    """(h [N, hc, D], next token [N], target [N], chained [N]) for every position i with a known target; chained:
    the row of position i + 1 of the same sequence (-1 at a sequence's end), for training chained drafts."""
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    with Appliance.from_config(BASE + [f"model.weights={directory}"]) as app:
        full = [p + r.token_ids for p, r in zip(work, app.generate(work, greedy))]
    streams: dict[str, dict[int, torch.Tensor]] = {}
    remember = DeepseekV4Runner._remember

    def record(self, asked, ran, hidden, worst_case):     # the final main streams of every prefilled position
        at = 0
        for i in flat_order(ran):
            s = ran[i]
            for k in range(len(s.token_ids)):
                streams.setdefault(s.request_id, {})[s.start_pos + k] = hidden[at + k].clone()
            at += len(s.token_ids)
        return remember(self, asked, ran, hidden, worst_case)

    DeepseekV4Runner._remember = record
    try:
        with Appliance.from_config(BASE + [f"model.weights={directory}", "speculative.method=mtp"]) as app:
            results = app.generate(full, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))
    finally:
        DeepseekV4Runner._remember = remember
    hs, nexts, targets, chained = [], [], [], []
    for seq, r in zip(full, results):
        argmax = [lp.top[0][0] if lp is not None else -1 for lp in r.prompt_logprobs]   # [j]: argmax at j - 1
        for i in range(len(seq) - 2):
            hs.append(streams[r.request_id][i])
            nexts.append(seq[i + 1])
            targets.append(argmax[i + 2])
            chained.append(len(hs) if i + 1 < len(seq) - 2 else -1)
    return torch.stack(hs), torch.tensor(nexts), torch.tensor(targets), torch.tensor(chained)


def mtp_forward(p: dict[str, torch.Tensor], fixed: dict[str, torch.Tensor], h: torch.Tensor, nxt: torch.Tensor,
                eps: float, hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP layer with its decoder block off (its output is zero): what the runner computes on such weights.
    The hyper-connection mixing weights are taken as constants for the gradient (their Sinkhorn runs in place)."""
    e = rms_norm(fixed["embed.weight"][nxt], p["enorm.weight"], eps)
    x = F.linear(e, p["e_proj.weight"]).unsqueeze(1) + F.linear(rms_norm(h, p["hnorm.weight"], eps), p["h_proj.weight"])
    for part in ("hc_attn", "hc_ffn"):
        with torch.no_grad():
            post, comb, y = hc_pre(x.detach(), fixed[f"mtp.0.{part}_fn"], fixed[f"mtp.0.{part}_base"],
                                   fixed[f"mtp.0.{part}_scale"], iters, hc_eps, eps)
        x = hc_post(torch.zeros_like(y), x, post, comb)
    last = hc_head(x, p["hc_head_fn"], p["hc_head_base"], p["hc_head_scale"], hc_eps, eps)
    return F.linear(rms_norm(last, p["norm.weight"], eps), fixed["head.weight"]).float(), x


def mtp_logits(p: dict[str, torch.Tensor], fixed: dict[str, torch.Tensor], h: torch.Tensor, nxt: torch.Tensor,
               eps: float, hc_eps: float, iters: int) -> torch.Tensor:
    return mtp_forward(p, fixed, h, nxt, eps, hc_eps, iters)[0]


def train(state: dict[str, torch.Tensor], data: tuple[torch.Tensor, ...], steps: int, seed: int) -> dict[str, float]:
    lay = load_runtime_config(BASE).model.layout
    h, nxt, target, chained = data
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(h), generator=g)
    held_out = order[: len(h) // 10]
    train_rows = order[len(h) // 10:]
    p = {k: state[f"mtp.0.{k}"].clone().float().requires_grad_(True) for k in TRAINED}
    opt = torch.optim.Adam(p.values(), lr=5e-3)
    args = (lay.rms_norm_eps, lay.hc_eps, lay.hc_sinkhorn_iters)

    def accuracy(rows: torch.Tensor) -> float:
        with torch.no_grad():
            return float((mtp_logits(p, state, h[rows], nxt[rows], *args).argmax(-1) == target[rows]).float().mean())

    before = accuracy(held_out)
    for step in range(steps):
        batch = train_rows[torch.randint(len(train_rows), (512,), generator=g)]
        logits, out = mtp_forward(p, state, h[batch], nxt[batch], *args)
        loss = F.cross_entropy(logits, target[batch])
        # A chained draft: the next row from this row's output streams (as the runner drafts draft 2, 3).
        on = chained[batch] >= 0
        after = chained[batch][on]
        loss = loss + F.cross_entropy(mtp_logits(p, state, out[on], nxt[after], *args), target[after])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0:
            print(f"step {step}: loss {float(loss):.3f}", flush=True)
    for k, v in p.items():
        state[f"mtp.0.{k}"] = v.detach().to(state[f"mtp.0.{k}"].dtype)
    for name in state:                              # the block off: attention and every expert output zero
        if name.startswith("mtp.0.") and name.endswith(("attn.wo_b.weight", "w2.weight")):
            state[name] = torch.zeros_like(state[name])
    return {"rows": len(h), "held_out_argmax_agreement_before": before, "held_out_argmax_agreement": accuracy(held_out)}


def bench(directory: Path, batch: int, k: int | None, new_tokens: int, seed: int) -> dict[str, float]:
    spec = [] if k is None else ["speculative.method=mtp", f"speculative.num_tokens={k}"]
    config = BASE + [f"model.weights={directory}", f"max_num_seqs={batch}", f"decode_batch={batch}", *spec]
    work = prompts(batch, seed, 16, 64)
    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    with Appliance.from_config(config) as app:
        app.generate(work[:1], SamplingParams(temperature=0.0, max_tokens=2))        # warm up
        steps0 = app.engine.steps
        t0 = time.perf_counter()
        results = app.generate(work, greedy)
        elapsed = time.perf_counter() - t0
        steps = app.engine.steps - steps0
        s = app.engine.stats()
    tokens = sum(len(r.token_ids) for r in results)
    out = {"batch": batch, "k": k or 0, "tokens": tokens, "steps": steps, "seconds": elapsed,
           "tok_per_s": tokens / elapsed, "tokens_per_step_per_seq": tokens / steps / batch,
           "outputs": [r.token_ids for r in results]}
    if s.spec_rows:
        out["tokens_per_verify_row"] = 1 + s.spec_accepted / s.spec_rows
        out["acceptance_by_position"] = list(s.spec_acceptance_by_position)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--sequences", type=int, default=96)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--std", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bench-only", action="store_true", help="benchmark OUT/distilled as it is")
    ap.add_argument("--batches", default="1,8,32")
    args = ap.parse_args()
    torch.set_num_threads(1)
    distilled = args.out / "distilled"
    report: dict = {}
    if not args.bench_only:
        t0 = time.perf_counter()
        state = main_model_checkpoint(args.out / "main", args.seed, args.std)
        data = collect(args.out / "main", prompts(args.sequences, args.seed + 1), args.new_tokens)
        report["training"] = train(state, data, args.steps, args.seed)
        save_checkpoint(distilled, load_runtime_config(BASE).model, state)
        report["training"]["seconds"] = time.perf_counter() - t0
        print(json.dumps(report["training"]), flush=True)
    runs = []
    for batch in (int(b) for b in args.batches.split(",")):
        base = None
        for k in (None, 1, 2, 3):
            r = bench(distilled, batch, k, args.new_tokens, args.seed + 2)
            if k is None:
                base = r["outputs"]
            r["greedy_equal"] = r["outputs"] == base
            del r["outputs"]
            runs.append(r)
            print(json.dumps(r), flush=True)
    report["runs"] = runs
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
