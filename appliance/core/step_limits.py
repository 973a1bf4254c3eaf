"""The shapes one engine step may take: the scheduler obeys them, the startup profile measures their worst.

The KV cache is sized from the peak memory of a profiling run (npu.launcher), so that peak is a bound only
if no step the scheduler issues is heavier than a profiled one. Both sides therefore read one description,
`step_limits(rc)`: the scheduler never exceeds it, and `worst_steps(limits)` lists the heaviest steps it
allows, which the launcher runs (on scratch pages, with the sampler at its largest batch) before planning.

Which step is heaviest depends on the runner's math, so every extreme is listed, not one guess:
- the largest decode gather: decode_batch rows at full context (runs first, so that buffers a runner keeps
  between steps, such as a gather workspace, are at their largest while the others run);
- one sequence with the whole chunk cap at full context (the widest attention: chunk x max_model_len);
- the budget as chunks from position 0, as many as fit (one attention call over equal chunks);
- the budget as equal chunks at full context, in the fewest chunks and in the most (runners that attend to
  chunks of equal length together, wherever they start, peak at one of these two: with the budget fixed,
  the scores grow with the chunk length and the keys read with the number of sequences, so their sum
  is largest at an end of the range);
- decode_batch decodes plus the rest of the budget as chunks at full context (runners that pad every row
  of a step to its longest chunk peak here).
Contexts end at max_model_len, one token beyond what a request can reach (its last token is sampled, never
computed), so the profile errs on the safe side. A chunk of two or more tokens starts on a block boundary,
as the scheduler issues it (a partial prefill chunk ends on one) and as ring caches need (DeepSeek V4's
compressor-state rings keep just the pages an aligned chunk touches): "at full context" is the latest
aligned start. When max_model_len - chunk is not aligned, the longest chunk cannot end at max_model_len, so
both ends of that trade are profiled: the full chunk from the last aligned start that fits, and the shorter
chunk from the next boundary to max_model_len. Extremes that come out as the same step (with max_model_len
equal to the chunk, the prefill wave is also the long chunks at full context) run once, named "a = b".

`least_steps(limits)` lists the smallest steps (one decode row, short chunks), which the launcher runs after
them: a kernel that picks its variant by a step's size (the Triton grouped GEMM's 16-row tiles for a few rows, a
JIT-compiled variant a GPU builds on first use) has met every size class before the first request, so no request
waits for a compile.
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.core.config import RuntimeConfig


@dataclass(frozen=True)
class StepLimits:
    """What one step may hold. The scheduler's bounds; the profile's worst cases are built from them."""

    max_tokens: int          # tokens computed in one step (max_num_batched_tokens)
    max_seqs: int            # sequences in one step (max_num_seqs)
    max_decode_rows: int     # one-token rows in one step (decode_batch, at most max_seqs and max_tokens)
    max_chunk: int           # tokens one sequence computes in one step (layout.tokens_in_flight caps it for rings)
    max_context: int         # tokens a sequence holds, this step's included (max_model_len)
    chunk_align: int         # a chunk of 2+ tokens starts at a multiple of this (block_size)
    draft_tokens: int = 0    # speculative decoding: tokens a decode row verifies after its own (speculative.num_tokens)

    @property
    def decode_tokens(self) -> int:
        """Tokens one decode row computes: its token and the drafts it verifies."""
        return 1 + self.draft_tokens

    @property
    def max_sampled_rows(self) -> int:
        """Logits rows the sampler may get in one step: one per scheduled sequence, and a verifying decode row's
        one per position it verifies."""
        return min(self.max_seqs, self.max_tokens) + self.max_decode_rows * self.draft_tokens


@dataclass(frozen=True)
class SeqShape:
    """One sequence's share of a step: num_tokens computed after start_pos cached tokens."""

    num_tokens: int
    start_pos: int
    draft_tokens: int = 0    # a verifying decode row: the last draft_tokens of num_tokens are drafted in the step

    @property
    def end(self) -> int:
        return self.start_pos + self.num_tokens


@dataclass(frozen=True)
class StepShape:
    name: str
    seqs: tuple[SeqShape, ...]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


def step_limits(rc: RuntimeConfig) -> StepLimits:
    """The one description of a legal step for this config (what the scheduler and the profile both read)."""
    in_flight = rc.model.layout.tokens_in_flight
    chunk = min(in_flight, rc.max_num_batched_tokens) if in_flight else rc.max_num_batched_tokens
    return StepLimits(
        max_tokens=rc.max_num_batched_tokens, max_seqs=rc.max_num_seqs,
        max_decode_rows=min(rc.decode_batch, rc.max_num_seqs,
                            rc.max_num_batched_tokens // (1 + rc.speculative.draft_tokens)),
        max_chunk=min(chunk, rc.max_model_len), max_context=rc.max_model_len, chunk_align=rc.block_size,
        draft_tokens=rc.speculative.draft_tokens)


def _chunks(tokens: int, chunk: int, count: int) -> list[int]:
    """Up to `count` chunk lengths of at most `chunk` tokens adding up to at most `tokens`; a chunk has at
    least 2 tokens (a 1-token row is a decode row, which the step's decode limit counts)."""
    lengths: list[int] = []
    while tokens >= 2 and len(lengths) < count:
        lengths.append(min(chunk, tokens))
        tokens -= lengths[-1]
    return lengths


def _equal_chunks(tokens: int, chunk: int, num: int) -> list[int]:
    """`num` equal chunks holding as many of `tokens` as fit, at most `chunk` tokens each."""
    return [min(chunk, tokens // num)] * num


def _at_end(num_tokens: int, limits: StepLimits) -> SeqShape:
    """A chunk of num_tokens from the latest aligned start where it still fits in max_context."""
    align = limits.chunk_align
    return SeqShape(num_tokens, (limits.max_context - num_tokens) // align * align)


def worst_steps(limits: StepLimits) -> tuple[StepShape, ...]:
    """The heaviest steps `limits` allow, each within them (see the module docstring); decode gather first."""
    ctx, chunk, rows = limits.max_context, limits.max_chunk, limits.max_decode_rows
    decode = tuple(SeqShape(limits.decode_tokens, ctx - limits.decode_tokens, limits.draft_tokens)
                   for _ in range(rows))
    steps = []
    if decode:
        steps.append(StepShape("decode_gather", decode))
    if chunk >= 2:
        long_chunk = _at_end(chunk, limits)
        steps.append(StepShape("long_chunk", (long_chunk,)))
        tail = ctx - (long_chunk.start_pos + limits.chunk_align)
        if long_chunk.end < ctx and tail >= 2:
            steps.append(StepShape("chunk_to_full_context", (_at_end(tail, limits),)))
        wave = _chunks(limits.max_tokens, chunk, limits.max_seqs)
        if len(wave) > 1:
            steps.append(StepShape("prefill_wave", tuple(SeqShape(n, 0) for n in wave)))
        most = min(limits.max_seqs, limits.max_tokens // 2)       # chunks of 2+ tokens (1 token is a decode row)
        fewest = min(most, -(-limits.max_tokens // chunk))
        for name, num in (("long_chunks_at_full_context", fewest), ("short_chunks_at_full_context", most)):
            if num > 1 and (name.startswith("long") or most > fewest):
                chunks = _equal_chunks(limits.max_tokens, chunk, num)
                steps.append(StepShape(name, tuple(_at_end(n, limits) for n in chunks)))
        mixed = _chunks(limits.max_tokens - rows * limits.decode_tokens, chunk, limits.max_seqs - rows)
        if decode and mixed:
            steps.append(StepShape("decodes_and_chunks", decode + tuple(_at_end(n, limits) for n in mixed)))
    distinct: dict[tuple[tuple[int, int], ...], StepShape] = {}     # by shape, in order of first appearance
    for step in steps:
        key = tuple(sorted((s.num_tokens, s.start_pos) for s in step.seqs))
        same = distinct.get(key)
        distinct[key] = step if same is None else StepShape(f"{same.name} = {step.name}", same.seqs)
    return tuple(distinct.values())


def least_steps(limits: StepLimits) -> tuple[StepShape, ...]:
    """The smallest steps `limits` allow: one decode row (with its drafts) at full context, and where chunks are
    allowed a 2-token chunk from position 0 and one after a block of cached tokens (a prefix hit's or a long
    prompt's later chunk, which the worst steps lack when max_model_len is one chunk)."""
    ctx, align = limits.max_context, limits.chunk_align
    steps = []
    if limits.max_decode_rows:
        steps.append(StepShape("one_decode_row", (SeqShape(limits.decode_tokens, ctx - limits.decode_tokens,
                                                            limits.draft_tokens),)))
    if limits.max_chunk >= 2:
        steps.append(StepShape("short_chunk", (SeqShape(2, 0),)))
        if align + 2 <= ctx:
            steps.append(StepShape("short_chunk_after_cached", (SeqShape(2, align),)))
    return tuple(steps)
