"""Qwen3Runner against transformers' Qwen3ForCausalLM on the same tiny random checkpoint (float32).

A small engine loop in this file drives the runner through StepBatch: staggered arrivals, chunked
prefills mixed with decodes of other sequences in one step, pages from a shuffled free list, each page
announced when first used (StepBatch.new_pages), as the engine does. Pools start uninitialized in serving;
here the oracle runs with pools that start full of NaN, on both decode paths (the CPU paged kernel, which
reads each row to its length, and gather + SDPA, whose masked columns would carry a NaN into the output).
"""

import dataclasses
import random

import pytest
import torch

from appliance.config.compose import load_runtime_config
from appliance.core.errors import ConfigError
from npu.qwen3.runner import Qwen3Runner
from npu.runner import ModelRunner
from npu.step import SeqStep, StepBatch
from tests.support.checkpoints import write_tiny_checkpoint
from tests.support.pools import pools_start_full_of_nan

PROMPT_LENS = (5, 23, 40, 12, 33, 1)
NEW_TOKENS = 20          # prefill + 19 decode steps per sequence
CHUNK = 16               # prefill chunk size: 23, 40 and 33 are prefilled over several steps
NEAR_TIE = 1e-4
LOGIT_TOL = 1e-4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    rc = load_runtime_config(["+model=qwen3_tiny"])
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3_tiny"), rc.model, seed=11, std=0.1)
    return dataclasses.replace(rc.model, weights=str(path))


def runner_with(ckpt, decode: str) -> Qwen3Runner:
    """The runner with its decode rows on the CPU paged kernel ("paged") or on gather + SDPA ("gather")."""
    r = Qwen3Runner(ckpt, "cpu")
    if decode == "gather":
        r.paged_decode = None
    else:
        assert r.paged_decode is not None
    r.load_weights()
    return r


@pytest.fixture(scope="module")
def runner(ckpt):
    return runner_with(ckpt, "paged")


@pytest.fixture(scope="module")
def hf(ckpt):
    transformers = pytest.importorskip("transformers")
    model = transformers.Qwen3ForCausalLM.from_pretrained(ckpt.weights, torch_dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None     # generate exactly NEW_TOKENS tokens
    return model


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in PROMPT_LENS]


def drive(runner, prompts, num_blocks, new_tokens=NEW_TOKENS, chunk=CHUNK, seed=0):
    """Greedy generation through StepBatch; sequence i arrives at step i. Returns tokens and per-token logits."""
    runner.allocate_pools({"kv": num_blocks}, 4)
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    bs = runner.block_size
    state = [dict(prompt=p, done=0, gen=[], logits=[], table=[]) for p in prompts]
    step = 0
    while any(len(s["gen"]) < new_tokens for s in state):
        seqs, owners, new = [], [], []
        for i, s in enumerate(state):
            if i > step or len(s["gen"]) >= new_tokens:
                continue
            if s["done"] < len(s["prompt"]):
                toks = s["prompt"][s["done"]:s["done"] + chunk]
                sample = s["done"] + len(toks) == len(s["prompt"])
            else:
                toks, sample = [s["gen"][-1]], True
            while len(s["table"]) * bs < s["done"] + len(toks):
                s["table"].append(free.pop())
                new.append(s["table"][-1])
            seqs.append(SeqStep(f"r{i}", list(toks), s["done"], {"kv": list(s["table"])}, sample=sample))
            owners.append((i, len(toks), sample))
        logits = runner.execute(StepBatch(seqs, new_pages={"kv": new}))
        assert logits.dtype == torch.float32
        assert logits.shape == (sum(o[2] for o in owners), runner.model.layout.vocab_size)
        row = 0
        for i, n, sample in owners:
            state[i]["done"] += n
            if sample:
                state[i]["gen"].append(int(logits[row].argmax()))
                state[i]["logits"].append(logits[row].clone())
                row += 1
        step += 1
    return [s["gen"] for s in state], [torch.stack(s["logits"]) for s in state]


def assert_matches_transformers(hf, prompts, tokens, logits):
    """Our logits == transformers' teacher-forced logits on our tokens; greedy tokens equal but at near-ties."""
    full_matches = 0
    for prompt, ours, our_logits in zip(prompts, tokens, logits):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=2)[0, len(prompt):].tolist()
            # Teacher-forced on our tokens: HF's logits at every position we sampled from.
            forced = hf(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1:-1]
        assert (forced - our_logits).abs().max().item() < LOGIT_TOL
        diverge = next((k for k, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
        if diverge is None:
            full_matches += 1
            continue
        top2 = forced[diverge].topk(2).values
        assert (top2[0] - top2[1]).item() < NEAR_TIE, (
            f"prompt of {len(prompt)} tokens diverges from transformers at new token {diverge} "
            f"({ours[diverge]} vs {ref[diverge]}) without a near-tie (gap {(top2[0] - top2[1]).item():.2e})")
    assert full_matches >= len(prompts) - 1, "near-ties should be rare; most sequences must match entirely"


@pytest.mark.parametrize("decode", ["paged", "gather"])
def test_greedy_tokens_and_logits_match_transformers(ckpt, hf, prompts, decode, monkeypatch):
    pools_start_full_of_nan(monkeypatch)
    tokens, logits = drive(runner_with(ckpt, decode), prompts, num_blocks=64)
    assert_matches_transformers(hf, prompts, tokens, logits)


def test_the_prefill_kernel_matches_transformers_at_head_dim_64(tmp_path, prompts, monkeypatch):
    """head_dim 64: prefill chunks from position 0 go to the CPU prefill kernel (npu.prefill_attention_cpu) where
    the CPU has its float32 path; the same oracle holds (the qwen3_tiny layout's head_dim 16 stays on SDPA)."""
    transformers = pytest.importorskip("transformers")
    rc = load_runtime_config(["+model=qwen3_tiny", "model.layout.head_dim=64", "model.cache_groups.0.row.width=256"])
    model = dataclasses.replace(rc.model, weights=str(write_tiny_checkpoint(tmp_path, rc.model, seed=12, std=0.1)))
    hf = transformers.Qwen3ForCausalLM.from_pretrained(model.weights, torch_dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    r = Qwen3Runner(model, "cpu")
    if r.prefill_attention is None:
        pytest.skip("this CPU has no AVX-512 float32 prefill path: the runner uses SDPA (tested above)")
    r.load_weights()
    pools_start_full_of_nan(monkeypatch)
    tokens, logits = drive(r, prompts, num_blocks=64)
    assert_matches_transformers(hf, prompts, tokens, logits)


@pytest.mark.parametrize("decode", ["paged", "gather"])
def test_pools_that_start_full_of_nan_give_what_zeroed_pools_give(ckpt, prompts, decode, monkeypatch):
    """Bit for bit: every row a step reads unmasked was written, and every page it reads is zeroed before it is
    read (page 0 for padding and the scratch pages at allocation, each other page when first announced)."""
    r = runner_with(ckpt, decode)
    monkeypatch.setattr(ModelRunner, "empty_pool", lambda self, shape, dtype: torch.zeros(shape, dtype=dtype))
    zeroed = drive(r, prompts, num_blocks=48)
    pools_start_full_of_nan(monkeypatch)
    poisoned = drive(r, prompts, num_blocks=48)
    assert r.pools["kv"][:, 0].eq(0).all() and r.pools["kv"][:, 48:].eq(0).all()   # zeroed at allocation
    assert r.pools["kv"].isnan().any(), "pages never used keep their NaN: nothing clears the whole pool"
    assert poisoned[0] == zeroed[0]
    assert all(torch.equal(a, b) for a, b in zip(poisoned[1], zeroed[1]))


@pytest.mark.parametrize("decode, finite", [("paged", True), ("gather", False)])
def test_a_page_not_announced_reaches_the_gather_paths_output_under_its_mask(ckpt, monkeypatch, decode, finite):
    """Why the kv pool is zeroed on first use: decode rows of different lengths share one gather + SDPA call, which
    masks the short row's columns past its position, and a NaN there still comes through (NaN x 0 = NaN). The paged
    kernel reads each row only to its length. Announced (as the engine announces every page it hands out), the
    page is zeroed before it is read and both paths give the row's logits alone."""
    pools_start_full_of_nan(monkeypatch)
    r = runner_with(ckpt, decode)
    short, long_ = [5, 6, 7], list(range(3, 23))
    tables = {"short": {"kv": [1]}, "long": {"kv": [2, 3]}}
    outcome = {}
    for announce in (False, True):
        r.allocate_pools({"kv": 8}, 1)
        for name, tokens in (("short", short), ("long", long_)):
            r.execute(StepBatch([SeqStep(name, tokens, 0, tables[name], sample=False)],
                                new_pages=tables[name] if announce else {}))
        decode_step = [SeqStep("short", [9], 3, tables["short"]), SeqStep("long", [9], 20, tables["long"])]
        outcome[announce] = r.execute(StepBatch(decode_step))
        alone = r.execute(StepBatch(decode_step[:1]))[0]
    assert bool(outcome[False][0].isfinite().all()) == finite       # the short row, read under the long row's mask
    assert outcome[True].isfinite().all() and (outcome[True][0] - alone).abs().max().item() < 1e-5


def test_one_runner_two_pool_sizes_same_outputs(runner, prompts):
    tokens_a, logits_a = drive(runner, prompts, num_blocks=40, seed=1)
    assert runner.pools["kv"].shape[1] == 40 + 4
    tokens_b, logits_b = drive(runner, prompts, num_blocks=97, seed=2)
    assert runner.pools["kv"].shape[1] == 97 + 4
    assert tokens_a == tokens_b
    for a, b in zip(logits_a, logits_b):
        assert (a - b).abs().max().item() < 1e-5


def test_batching_and_chunking_do_not_change_greedy_output(runner, prompts):
    together, _ = drive(runner, prompts, num_blocks=64)
    for i, prompt in enumerate(prompts):
        alone, _ = drive(runner, [prompt], num_blocks=16, chunk=1 << 30, seed=i)
        assert alone[0] == together[i]


def test_short_block_table_is_a_clear_error(runner):
    runner.allocate_pools({"kv": 4}, 1)
    with pytest.raises(ValueError, match="request bad: block table 'kv' covers 16 tokens, the step needs 20"):
        runner.execute(StepBatch([SeqStep("bad", list(range(20)), 0, {"kv": [0]})]))


def test_mismatched_cache_group_is_rejected():
    model = load_runtime_config(["+model=qwen3_tiny"]).model
    narrow = dataclasses.replace(model.cache_groups[0], row_width=32)
    with pytest.raises(ConfigError, match=r"model.cache_groups\[0\].row.width = 32: must be 2 x num_kv_heads x head_dim = 64"):
        Qwen3Runner(dataclasses.replace(model, cache_groups=(narrow,)), "cpu")


def _prefill_alone(runner, prompts, first_page=0):
    """Prefill each prompt in a step of its own on consecutive pages; returns each sequence's page table."""
    tables, page = [], first_page
    for i, prompt in enumerate(prompts):
        n = -(-(len(prompt) + 1) // runner.block_size)      # room for one decode token
        tables.append(list(range(page, page + n)))
        page += n
        runner.execute(StepBatch([SeqStep(f"s{i}", list(prompt), 0, {"kv": tables[-1]}, sample=False)]))
    return tables


def test_decode_rows_of_very_different_lengths_match_each_alone(runner):
    """A decode batch whose contexts differ a lot is split into buckets and reordered; each sampled row
    must equal the same decode step run alone (which has one row and no padding)."""
    from npu.qwen3.step_layout import decode_buckets
    lengths = [3, 300, 17, 150, 40, 299, 5, 90, 260, 1, 33, 180]
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]
    runner.allocate_pools({"kv": 128}, 1)
    tables = _prefill_alone(runner, prompts)
    widths = sorted((-(-(n + 1) // runner.block_size) for n in lengths), reverse=True)
    assert len(decode_buckets(widths, runner.block_size)) > 1, "the batch must exercise several buckets"
    steps = [SeqStep(f"s{i}", [rng.randrange(3, 512)], len(p), {"kv": t}, sample=i % 3 != 1)
             for i, (p, t) in enumerate(zip(prompts, tables))]
    together = runner.execute(StepBatch(steps))
    alone = [runner.execute(StepBatch([dataclasses.replace(s, sample=True)]))[0] for s in steps if s.sample]
    assert together.shape == (len(alone), runner.model.layout.vocab_size)
    for row, ref in zip(together, alone):
        assert (row - ref).abs().max().item() < 1e-5


def test_prefill_chunks_in_one_step_match_each_alone(runner):
    """Chunks from position 0 of equal length share one attention call; with chunks of other lengths, a
    chunk after cached tokens and decode rows in the same step, each must equal its step run alone."""
    rng = random.Random(8)
    cached = [rng.randrange(3, 512) for _ in range(21)]
    runner.allocate_pools({"kv": 64}, 1)
    (t_cached, t_dec) = _prefill_alone(runner, [cached[:13], [5, 6, 7]])
    t_cached = t_cached + [60, 61]                           # room for the second chunk
    steps, page = [], 20
    for i, n in enumerate([16, 7, 16, 30, 7, 16]):
        pages = -(-n // runner.block_size)
        steps.append(SeqStep(f"f{i}", [rng.randrange(3, 512) for _ in range(n)], 0,
                             {"kv": list(range(page, page + pages))}, sample=i != 2))
        page += pages
    steps.insert(2, SeqStep("later", cached[13:], 13, {"kv": t_cached}))
    steps.insert(5, SeqStep("dec", [9], 3, {"kv": t_dec}))
    together = runner.execute(StepBatch(steps))
    alone = [runner.execute(StepBatch([s]))[0] for s in steps if s.sample]
    assert together.shape == (len(alone), runner.model.layout.vocab_size)
    for row, ref in zip(together, alone):
        assert (row - ref).abs().max().item() < 1e-5


def test_decode_buckets_split_where_the_width_halves_and_padding_pays():
    from npu.qwen3.step_layout import SPLIT_MIN_SAVING, decode_buckets
    assert decode_buckets([4, 4, 4], 16) == [(0, 3)]
    # 16-token pages: at width 6 the widest is 19 >= 2 x 6, and 7 rows x 13 pages x 16 = 1456 >= 1024 tokens;
    # after that no row halves 6 with enough rows left (at width 3: 6 x 3 x 16 = 288).
    assert SPLIT_MIN_SAVING == 1024
    assert decode_buckets([19, 19, 17, 12, 10, 6, 3, 3, 2, 1, 1, 1], 16) == [(0, 5), (5, 12)]
    assert decode_buckets([19, 19, 17, 12, 10, 6, 3, 3, 2, 1, 1, 1], 1) == [(0, 12)]   # 1-token pages: too little


def test_page_id_out_of_range_is_a_clear_error(runner):
    runner.allocate_pools({"kv": 4}, 1)
    for bad in ([7], [5], [-1]):                      # 5 = the pool's page count: the first id past the end
        with pytest.raises(ValueError, match=r"request bad: page id out of range \[0, 5\)"):
            runner.execute(StepBatch([SeqStep("ok", [1], 0, {"kv": [0]}),
                                      SeqStep("bad", [1, 2], 0, {"kv": bad})]))
