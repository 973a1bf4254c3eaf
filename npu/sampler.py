"""Batched sampling on the device: greedy, temperature, top-k, top-p, with a seeded generator per request.

Each request draws from its own torch.Generator, so a sampled output depends on the request's seed and
its logits only, never on which other requests share the batch. Greedy rows only take an argmax: a batch
of greedy rows never sorts, scales or draws.
"""

from __future__ import annotations

import ctypes

import numpy
import torch

from appliance.core.request import SamplingParams, TokenLogprob
from npu.cpu_kernels import SUFFIX, entry, kernels_for, ptr


def worst_case_rows(n: int) -> list[tuple[str, SamplingParams]]:
    """n rows on the sampler's costliest path (temperature, top-k and top-p all on, each with its own
    generator): what the startup profile samples at the largest batch a step can produce."""
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9)
    return [(f"profile-{i}", params) for i in range(n)]


# Float dtypes numpy reads straight from a CPU tensor's memory (bfloat16 has no numpy dtype).
_NUMPY_FLOATS = (torch.float32, torch.float64, torch.float16)


# Rows of lower-precision logits widened to float32 at a time for numpy's argmax (where the compiled argmax is not
# built): a [8, vocab] float32 block (1 MB at a 32k vocabulary) is reused from the allocator each time and stays in
# cache.
WIDEN_ROWS = 8


class CpuArgmax:
    """The compiled row argmax (npu/kernels/argmax.cpp) for one dtype: the first maximal id of each row, a NaN
    above every number, as numpy and torch rule; rows split over torch's threads."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype):
        self.fn = entry(lib, "argmax_rows", dtype)

    def __call__(self, logits: torch.Tensor) -> list[int]:
        rows, vocab = logits.shape
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        out = torch.empty(rows, dtype=torch.long)
        self.fn(ptr(logits), ctypes.c_int64(rows), ctypes.c_int64(vocab), ctypes.c_int64(logits.stride(0)), ptr(out),
                ctypes.c_int(torch.get_num_threads()))
        return out.tolist()


_cpu_argmax: dict[torch.dtype, CpuArgmax | None] = {}     # per dtype: the kernel, or None where it is not built


def cpu_argmax(dtype: torch.dtype) -> CpuArgmax | None:
    """The compiled argmax for CPU logits of `dtype`, looked up once per process (npu.cpu_kernels logs why not)."""
    if dtype not in _cpu_argmax:
        lib = kernels_for(torch.device("cpu"), dtype, "the greedy argmax")
        _cpu_argmax[dtype] = None if lib is None else CpuArgmax(lib, dtype)
    return _cpu_argmax[dtype]


def greedy_ids(logits: torch.Tensor) -> list[int]:
    """The argmax of every row of [rows, vocab] logits, as host ints; the first maximal id on ties (both
    torch's and numpy's rule). On the CPU the compiled argmax where it is built (float32 or bfloat16), else numpy's:
    torch's reduction along the last dim is about ten times slower. On [64, 32000] logits on the 2-core benchmark
    machine (an Intel Xeon): torch 4.0 ms bf16 / 1.6 ms float32, numpy 0.60 / 0.28 ms (bf16 widened to float32 8
    rows at a time, exact), the kernel 0.14 / 0.17 ms, where a bf16 decode step of the 4 x 512 model takes 7.8 ms."""
    if logits.device.type == "cpu" and logits.dim() == 2 and logits.shape[0] and logits.shape[1]:
        kernel = cpu_argmax(logits.dtype) if logits.dtype in SUFFIX else None     # the kernels' dtypes
        if kernel is not None:
            return kernel(logits.detach())
    if logits.device.type == "cpu" and logits.dtype in _NUMPY_FLOATS:
        return numpy.argmax(logits.detach().numpy(), axis=-1).tolist()
    if logits.device.type == "cpu" and logits.is_floating_point():
        return [i for rows in logits.split(WIDEN_ROWS) for i in numpy.argmax(rows.float().numpy(), axis=-1).tolist()]
    return logits.argmax(dim=-1).tolist()


# Rows of logits turned into log-probabilities at a time: a prompt's logprobs need one row per prompt token, and a
# whole long prompt's [tokens, vocab] float32 block at once would be gigabytes.
LOGPROB_ROWS = 256


def logprob_tensors(logits: torch.Tensor, ids: torch.Tensor, num_top: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The device half of token_logprobs for rows of logits [R, vocab] and token ids [R] on the same device:
    (chosen logprob [R], rank [R], top logprobs [R, num_top], top ids [R, num_top]) under log_softmax (float32)."""
    lp = logits.float().log_softmax(dim=-1)
    chosen = lp.gather(1, ids[:, None])
    ranks = (lp > chosen).sum(dim=-1) + 1
    top_lp, top_ids = lp.topk(num_top, dim=-1) if num_top else (lp[:, :0], ids[:, None][:, :0])
    return chosen.squeeze(1), ranks, top_lp, top_ids


@torch.inference_mode()
def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprob]:
    """Row i: the logprob and rank of token_ids[i] and the num_top[i] most likely tokens under log_softmax(logits[i])
    (float32, the raw logits: the model's distribution, before temperature or top-k/top-p). Computed where the
    logits are (logprob_tensors); only those few numbers per row come to the host, never a vocabulary-wide row."""
    out: list[TokenLogprob] = []
    for lo in range(0, len(token_ids), LOGPROB_ROWS):
        hi = min(lo + LOGPROB_ROWS, len(token_ids))
        ids = torch.tensor(token_ids[lo:hi]).to(logits.device, non_blocking=True)
        chosen, ranks, top_lp, top_ids = logprob_tensors(logits[lo:hi], ids, max(num_top[lo:hi]))
        chosen_h, ranks_h = chosen.tolist(), ranks.tolist()
        top_lp_h, top_ids_h = top_lp.tolist(), top_ids.tolist()
        for r in range(hi - lo):
            n = num_top[lo + r]
            out.append(TokenLogprob(token_ids[lo + r], chosen_h[r], ranks_h[r],
                                    tuple(zip(top_ids_h[r][:n], top_lp_h[r][:n]))))
    return out


BITS_PER_WORD = 32


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 bitmasks (bit j of word w allows id 32 * w + j, llguidance's and xgrammar's layout) ->
    [rows, vocab_size] bool. Shifting the sign bit of a negative word is an arithmetic shift: `& 1` still reads it."""
    bits = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab_size]


def forbidden_tokens(bitmask: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab_size] bool, True where the bitmask forbids the token. For CPU logits numpy unpacks the bits (one
    call: 6x faster than torch's shift-and-mask on a 2-core host, where every small torch op costs microseconds);
    for an accelerator the int32 words travel (32x smaller than the bools) and are unpacked there. The numpy path
    reads the words as little-endian bytes, as every host this runs on stores them."""
    if device.type == "cpu":
        bits = numpy.unpackbits(bitmask.numpy().view(numpy.uint8), axis=-1, bitorder="little")[:, :vocab_size]
        return torch.from_numpy(bits == 0)
    return ~allowed_tokens(bitmask.to(device, non_blocking=True), vocab_size)


@torch.inference_mode()
def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Set logits[rows[i], t] to -inf (in place) for every token t that bitmask[i] does not allow: the grammar of a
    structured-output row. Greedy, sampling and logprobs then all read the masked logits. Rows not listed (the
    unconstrained ones) are not read or written."""
    forbidden = forbidden_tokens(bitmask, logits.shape[-1], logits.device)
    for i, row in enumerate(rows):
        logits[row].masked_fill_(forbidden[i], float("-inf"))


class HostCopy:
    """Sampled ids on their way to the host, started as soon as they are drawn: on an accelerator a copy into pinned
    memory queued right behind them, and an event, so that reading them later waits for that step's work only, never
    for a step queued since (async scheduling launches the next step before it reads these)."""

    def __init__(self, ids: torch.Tensor):
        self.event = None
        if ids.device.type == "cpu":
            self.host = ids
            return
        self.host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
        self.host.copy_(ids, non_blocking=True)
        self.event = getattr(torch, ids.device.type).Event()     # torch.cuda.Event, torch.npu.Event
        self.event.record()

    def tolist(self) -> list[int]:
        """The ids, once the copy is done (waits for it)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class Sampler:
    def __init__(self, device: torch.device, base_seed: int = 0):
        self.device = device
        self.base_seed = base_seed
        self._generators: dict[str, torch.Generator] = {}
        self._counter = 0

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            self._counter += 1
            seed = params.seed if params.seed is not None else self.base_seed * 1_000_003 + self._counter
            gen = torch.Generator(device=self.device).manual_seed(seed)
            self._generators[request_id] = gen
        return gen

    def generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        """The request's generator (created on first use): speculative verification draws from it too."""
        return self._generator(request_id, params)

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: list[tuple[str, SamplingParams]]) -> list[int]:
        """logits [len(rows), vocab] -> one token id per row, on the host. On a CPU greedy rows take numpy's argmax
        (greedy_ids); on a device every row is drawn there (draw) and the ids come back in one copy."""
        if logits.device.type != "cpu":
            return self.draw(logits, rows).tolist()
        tokens = greedy_ids(logits)
        random_rows = [i for i, (_, p) in enumerate(rows) if not p.greedy]
        if random_rows:
            drawn = self._draw_random(logits, rows, random_rows).tolist()
            for row, token in zip(random_rows, drawn):
                tokens[row] = token
        return tokens

    @torch.inference_mode()
    def sample_ids(self, logits: torch.Tensor, rows: list[tuple[str, SamplingParams]]) -> torch.Tensor:
        """One token id per row as an int64 tensor on the logits' device: drawn there without a host sync on an
        accelerator (draw); on a CPU, sample's host ids in a tensor."""
        if logits.device.type != "cpu":
            return self.draw(logits, rows)
        return torch.tensor(self.sample(logits, rows), dtype=torch.long)

    @torch.inference_mode()
    def draw(self, logits: torch.Tensor, rows: list[tuple[str, SamplingParams]]) -> torch.Tensor:
        """The device half of sample: token ids [len(rows)] int64 on the logits' device, no host sync."""
        ids = logits.argmax(dim=-1)
        random_rows = [i for i, (_, p) in enumerate(rows) if not p.greedy]
        if random_rows:
            at = torch.tensor(random_rows).to(logits.device, non_blocking=True)
            ids = ids.index_copy(0, at, self._draw_random(logits, rows, random_rows, at))
        return ids

    def _draw_random(self, logits: torch.Tensor, rows: list[tuple[str, SamplingParams]], random_rows: list[int],
                     at: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [len(random_rows)] on the logits' device for the rows that sample: temperature, top-k, top-p,
        then the exponential race (argmax of p / noise) with each row's own generator."""
        device = logits.device
        idx = at if at is not None else torch.tensor(random_rows).to(device, non_blocking=True)
        params = [rows[i][1] for i in random_rows]
        vocab = logits.shape[-1]
        knobs = torch.tensor([[p.temperature, p.top_k if p.top_k > 0 else vocab, p.top_p] for p in params],
                             dtype=torch.float64).to(device, non_blocking=True)
        temps, top_k, top_p = knobs.unbind(1)
        scaled = logits.index_select(0, idx).float() / temps[:, None].float()
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        outside = (probs.cumsum(dim=-1) - probs) >= top_p[:, None].float()
        probs = probs.masked_fill(outside, 0.0)
        noise = torch.stack([
            torch.empty(vocab, device=device).exponential_(generator=self._generator(rows[i][0], rows[i][1]))
            for i in random_rows])
        choice = (probs / noise).argmax(dim=-1)
        return order.gather(1, choice[:, None]).squeeze(1)
