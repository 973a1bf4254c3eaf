"""MTP speculative decoding on the tiny DeepSeek V4 (one rank): greedy output is identical to one-token decoding
for every prompt, with 1..3 drafts per row, batching, chunked prefill, prefix hits and preemption.

Random weights make the MTP layer propose almost nothing the main model accepts, which would leave rollback
untested. So the drafting pass is wrapped: the MTP layer still runs (its rows are written, its logits computed),
then its logits are replaced by a scripted drafter that proposes the reference's next token at most positions
and a wrong one at others. Every step then accepts some drafts and rejects others at every draft position, and
the outputs must still equal the reference: accepted positions are committed in every cache group and rejected
ones rolled back (rewritten later) in all of them, compressor states and compressed rows included.
"""

from __future__ import annotations

import random

import pytest
import torch

from appliance.core.request import SamplingParams
from appliance.offline import Appliance
from npu.deepseek_v4.moe import EXPERT_EXCHANGE_ENV
from npu.deepseek_v4.runner import DeepseekV4Runner

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 512
BASE = ["device=cpu", "device.cpu_threads=1", "max_model_len=160", "max_num_seqs=6", "decode_batch=6",
        "max_num_batched_tokens=64"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def reference(batch: list[list[int]], *overrides: str) -> list[list[int]]:
    with Appliance.from_config(BASE + list(overrides)) as app:
        return [r.token_ids for r in app.generate(batch, GREEDY)]


def wrong(pos: int) -> bool:
    """The scripted drafter's misses: about one position in four, irregularly (runs of hits and of misses)."""
    return random.Random(pos).random() < 0.25


@pytest.fixture
def scripted_drafter(monkeypatch):
    """Make the MTP pass's logits pick the reference's token at position i + 2 for row i (a wrong one where
    `wrong`); the reference is found by the request's first prompt tokens, seen in its first prefill chunk."""
    full: dict[tuple[int, ...], list[int]] = {}
    seen: dict[str, tuple[int, ...]] = {}
    execute, mtp_pass = DeepseekV4Runner.execute, DeepseekV4Runner._mtp_pass

    def watch(self, batch):
        for s in batch.seqs:
            if s.start_pos == 0 and not batch.worst_case:
                seen[s.request_id] = tuple(s.token_ids[:8])
        return execute(self, batch)

    def scripted(self, seqs, hidden, worst_case, fed=None):
        logits, last = mtp_pass(self, seqs, hidden, worst_case, fed)
        logits = torch.zeros_like(logits)
        for row, s in enumerate(seqs):
            tokens = full.get(seen.get(s.request_id, ()), [])
            pos = s.start_pos + len(s.token_ids) + 1            # the token row i predicts: i + 2
            good = tokens[pos] if pos < len(tokens) else 0
            logits[row, (good + 1) % VOCAB if wrong(pos) else good] = 1.0
        return logits, last

    monkeypatch.setattr(DeepseekV4Runner, "execute", watch)
    monkeypatch.setattr(DeepseekV4Runner, "_mtp_pass", scripted)

    def expect(batch: list[list[int]], outputs: list[list[int]]) -> None:
        full.update({tuple(p[:8]): p + out for p, out in zip(batch, outputs)})
    return expect


def speculative(k: int) -> list[str]:
    return ["speculative.method=mtp", f"speculative.num_tokens={k}"]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_speculation_gives_the_tokens_of_one_token_decoding(k, scripted_drafter, monkeypatch):
    batch = prompts(6, 1, 70, seed=k)
    expected = reference(batch)
    scripted_drafter(batch, expected)
    rows: dict[str, list[tuple[int, int, int]]] = {}        # request -> (start_pos, tokens, drafts) per step
    execute = DeepseekV4Runner.execute

    def recording(self, step_batch):
        if not step_batch.worst_case:
            for s in step_batch.seqs:
                rows.setdefault(s.request_id, []).append((s.start_pos, len(s.token_ids), s.num_draft))
        return execute(self, step_batch)

    monkeypatch.setattr(DeepseekV4Runner, "execute", recording)
    with Appliance.from_config(BASE + speculative(k)) as app:
        results = app.generate(batch, GREEDY)
        stats = app.engine.stats()
    assert [r.token_ids for r in results] == expected
    # Both branches ran at every draft position: some drafts accepted, some rolled back.
    assert len(stats.spec_accepted_by_position) == k
    assert all(0 < a < p for a, p in zip(stats.spec_accepted_by_position, stats.spec_proposed_by_position))
    assert stats.generation_tokens == sum(len(t) for t in expected)
    # Accepted drafts are committed by their verify step: the row's next step is one decode token right after
    # them (recomputing them would make it a longer chunk starting earlier).
    skipped = []
    for steps in rows.values():
        for (start, _, drafts), (next_start, next_tokens, _) in zip(steps, steps[1:]):
            if drafts:
                assert next_tokens == 1 and 1 <= next_start - start <= 1 + drafts, (start, drafts, next_start)
                skipped.append(next_start - start - 1)
    assert 0 < sum(skipped) <= stats.spec_accepted


def test_greedy_speculation_with_preemption_and_prefix_hits(scripted_drafter):
    shared = prompts(1, 40, 40, seed=5)[0]
    batch = [shared + tail for tail in prompts(3, 1, 20, seed=6)] + prompts(5, 1, 90, seed=7)
    small = ["max_model_len=128", "kv_cache.num_slots_override=2"]
    expected = reference(batch, *small)
    scripted_drafter(batch, expected)
    with Appliance.from_config(BASE + small + speculative(3)) as app:
        first = app.generate(batch[:1], GREEDY)
        rest = app.generate(batch[1:], GREEDY)
        assert app.engine.scheduler.num_preemptions > 0
        stats = app.engine.stats()
    assert any(r.usage.cached_prompt_tokens > 0 for r in rest[:2])
    assert [r.token_ids for r in first + rest] == expected
    assert 0 < stats.spec_accepted < stats.spec_proposed


def test_mtp_layer_drafts_without_the_script_keep_greedy_output():
    """The MTP layer's own drafts (random weights: almost all rejected) never change the output either."""
    batch = prompts(4, 1, 40, seed=11)
    expected = reference(batch)
    with Appliance.from_config(BASE + speculative(2)) as app:
        results = app.generate(batch, GREEDY)
        stats = app.engine.stats()
    assert [r.token_ids for r in results] == expected
    assert stats.spec_proposed > 0


def test_greedy_speculation_with_tied_indexer_scores(monkeypatch, scripted_drafter):
    """An indexer whose queries are zero scores every visible CSA row alike: which rows a query attends is the tie
    rule's alone. A verified position must rank over the rows one-token decoding ranks over at that position
    (not over the rows the verify step's last position sees)."""
    random_weights = DeepseekV4Runner.random_weights

    def tied(self, seed, std=0.02, device=None):
        state = random_weights(self, seed, std, device)
        return {k: torch.zeros_like(v) if k.endswith("attn.indexer.wq_b.weight") else v for k, v in state.items()}

    monkeypatch.setattr(DeepseekV4Runner, "random_weights", tied)
    batch = prompts(4, 20, 60, seed=13)
    expected = reference(batch)
    scripted_drafter(batch, expected)
    with Appliance.from_config(BASE + speculative(3)) as app:
        results = app.generate(batch, GREEDY)
    assert [r.token_ids for r in results] == expected


DP2_EP2 = ["device.count=2", "parallel.data_parallel_size=2", "parallel.expert_parallel_size=2",
           "parallel.startup_timeout_s=120"]


@pytest.mark.parametrize("exchange", ["auto", "fixed"])
def test_greedy_speculation_on_data_2_expert_2(scripted_drafter, monkeypatch, exchange):
    """Both data ranks hold sequences and every step's MTP passes run their expert exchange in lockstep, also on a
    rank with no verifying row. Rank 0 (this process) drafts from the script, rank 1 with the MTP layer itself.
    fixed: the exchange in fixed shapes (as on an accelerator), bounded by the step's rows in every pass."""
    monkeypatch.setenv(EXPERT_EXCHANGE_ENV, exchange)
    batch = prompts(6, 1, 60, seed=17)
    expected = reference(batch)
    scripted_drafter(batch, expected)
    with Appliance.from_config(BASE + DP2_EP2 + speculative(2)) as app:
        results = app.generate(batch, GREEDY)
        stats = app.engine.stats()
    assert [r.token_ids for r in results] == expected
    assert 0 < stats.spec_accepted < stats.spec_proposed


def test_logprobs_of_verified_tokens_are_the_models(scripted_drafter):
    """Each emitted token's logprob comes from its own verified position: the one-token decoding's, to rounding
    (the verify step batches K + 1 positions)."""
    batch = prompts(3, 5, 40, seed=19)
    asked = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    with Appliance.from_config(BASE) as app:
        plain = app.generate(batch, asked)
    scripted_drafter(batch, [r.token_ids for r in plain])
    with Appliance.from_config(BASE + speculative(3)) as app:
        spec = app.generate(batch, asked)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    for a, b in zip(spec, plain):
        assert [lp.token_id for lp in a.logprobs] == b.token_ids
        assert [lp.logprob for lp in a.logprobs] == pytest.approx([lp.logprob for lp in b.logprobs], abs=1e-4)
        assert [[t for t, _ in lp.top] for lp in a.logprobs] == [[t for t, _ in lp.top] for lp in b.logprobs]


def test_sampled_requests_with_speculation_finish_with_valid_tokens(scripted_drafter):
    """Temperature, top-k and top-p with drafts (rejection sampling in the engine): every request gets its
    max_tokens tokens, each inside its top-k set, and some drafts are accepted."""
    batch = prompts(4, 5, 40, seed=23)
    expected = reference(batch)
    scripted_drafter(batch, expected)
    params = SamplingParams(temperature=0.8, top_k=3, max_tokens=24, ignore_eos=True, seed=7, logprobs=3)
    with Appliance.from_config(BASE + speculative(2)) as app:
        results = app.generate(batch, params)
        stats = app.engine.stats()
    for r in results:
        assert len(r.token_ids) == 24
        assert all(lp.token_id in [t for t, _ in lp.top] for lp in r.logprobs)     # drawn from the top 3
    assert stats.spec_accepted > 0


def test_constrained_rows_do_not_draft_and_keep_their_grammar():
    """Structured output with speculation on: a constrained row drafts nothing (its drafts would have to pass its
    grammar), so its text is one its grammar accepts; the unconstrained rows beside it still draft and keep the
    greedy tokens of one-token decoding."""
    from appliance.core.constraint import OutputConstraint
    from appliance.core.request import FinishReason

    plain = prompts(3, 1, 30, seed=17)
    expected = reference(plain)
    choice = SamplingParams(temperature=0.0, max_tokens=40,
                            constraint=OutputConstraint.choice(["alpha", "beta", "gamma"]))
    with Appliance.from_config(BASE + speculative(2)) as app:
        results = app.generate(plain + prompts(1, 5, 10, seed=18), [GREEDY] * 3 + [choice])
        stats = app.engine.stats()
    assert [r.token_ids for r in results[:3]] == expected
    assert results[3].finish_reason is FinishReason.STOP and results[3].text in ("alpha", "beta", "gamma")
    assert stats.spec_proposed > 0


def test_catch_up_rows_read_the_committed_tokens_also_when_they_were_drafts(monkeypatch, scripted_drafter):
    """A verify step's MTP catch-up writes rows for the tokens committed since the last drafting, most of them
    accepted drafts whose values only the device holds (fed, never read on the host): each row must get the token
    the sequence really has at the next position."""
    import npu.deepseek_v4.runner
    batch = prompts(3, 5, 40, seed=21)
    expected = reference(batch)
    scripted_drafter(batch, expected)
    catch_ups: list = []
    real = npu.deepseek_v4.runner.catch_up_rows

    def spy(history, start, first_token):
        found = real(history, start, first_token)
        if found is not None:
            tokens = list(found.tokens)
            if found.fed is not None:
                offset, fed = found.fed
                tokens[offset:offset + fed.shape[0]] = fed.tolist()
            catch_ups.append((found.first, tokens, found.fed is not None))
        return found

    monkeypatch.setattr(npu.deepseek_v4.runner, "catch_up_rows", spy)
    with Appliance.from_config(BASE + speculative(3)) as app:
        app.generate(batch, GREEDY)
    sequences = [p + out for p, out in zip(batch, expected)]
    assert any(fed for *_, fed in catch_ups), "no catch-up read a draft: the test would prove nothing"
    for first, tokens, _ in catch_ups:         # tokens: those at positions first + 1 .. start (the step's first)
        assert any(s[first + 1:first + 1 + len(tokens)] == tokens for s in sequences), \
            f"catch-up rows from {first} got {tokens}, which no sequence has there"


@pytest.mark.parametrize("zeroed", [True, False], ids=["mtp_zeroed_on_first_use", "mtp_left_uninitialized"])
def test_a_prefix_hit_past_an_mtp_row_never_written_drafts_from_zeros_not_nan(monkeypatch, zeroed):
    """Pools start full of NaN (tests/support/pools.py). A 64-token prompt finishes after its prefill (max_tokens 1),
    so its MTP layer never writes row 63 (a row is written once the next token is known); a longer prompt hits its 64
    cached tokens and drafts: the MTP window reads row 63 as a valid row. The `mtp` group's pages are zeroed when
    first used, so that row reads 0 as in a zeroed pool and the drafter's logits stay finite; left uninitialized
    (what the test shows for contrast), the NaN reaches every later drafting pass of the request."""
    from tests.support.pools import pools_start_full_of_nan
    pools_start_full_of_nan(monkeypatch)
    if not zeroed:
        init = DeepseekV4Runner.__init__

        def no_mtp_zeroing(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.zero_on_first_use = frozenset()
        monkeypatch.setattr(DeepseekV4Runner, "__init__", no_mtp_zeroing)
    passes, mtp_pass = [], DeepseekV4Runner._mtp_pass

    def watched(self, seqs, hidden, worst_case, fed=None):
        logits, last = mtp_pass(self, seqs, hidden, worst_case, fed)
        if seqs and not worst_case:
            passes.append(bool(logits.isnan().any()))
        return logits, last
    monkeypatch.setattr(DeepseekV4Runner, "_mtp_pass", watched)
    shared = prompts(1, 64, 64, seed=9)[0]
    longer = shared + prompts(1, 10, 10, seed=10)[0]
    expected = reference([longer])
    with Appliance.from_config(BASE + speculative(2)) as app:
        app.generate([shared], SamplingParams(max_tokens=1, ignore_eos=True))
        passes.clear()
        result = app.generate([longer], GREEDY)[0]
    assert result.usage.cached_prompt_tokens == 64 and len(passes) > 1
    assert result.token_ids == expected[0]               # verification keeps greedy output either way
    assert any(passes) != zeroed
