"""ModelRunner: the interface every model runner implements, and the steps they all share.

Shared here: the architecture's rules (checked on construction), weights (seeded random or a checkpoint
directory, checked against `expected_weights()` by name, shape and dtype before `install_weights`),
pools, and the scratch-page batches the startup profile runs (scratch_batch). Each runner adds its math.

Pools are allocated at runtime from the plan: one tensor per cache group shaped
[num_layers_in_group, num_blocks + num_scratch, rows_per_block, row_width], layer-major, so one layer's
pages (pool[layer]) are contiguous storage: a step reads them with block tables and never copies a
strided view of the pool (an accelerator would materialize one per layer). Kernels take block tables
and read strides from these tensors, so no pool size is baked into any shape.

Pools start uninitialized (torch.empty: a pool the size of the memory budget is never touched as a whole at start).
What a step may read before it writes is zero when first read: page 0 and the scratch pages from allocation, and
each runner names its groups whose pages must be zeroed when a step announces them (StepBatch.new_pages):
`state_groups` every time (rows that accumulate), `zero_on_first_use` the first time (a read of never-written rows
could reach the math there, e.g. SDPA's masked columns: a masked NaN still poisons the output, NaN x 0 = NaN). A
group in neither reads rows never written only under a torch.where mask.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Mapping, Sequence

import torch

from appliance.core.archs import check_model, rank_cache_groups
from appliance.core.checkpoint_config import check_checkpoint_config
from appliance.core.config import ModelSpec
from appliance.core.errors import CheckpointError
from appliance.core.kv_cache_spec import CacheGroupSpec
from appliance.core.parallel import RankPlace, TensorSlice
from appliance.core.step_limits import StepShape
from npu.collectives import Collective
from npu.huge_pages import advise_huge_pages
from npu.step import FedTokens, SeqStep, StepBatch, step_rows
from npu.weights import as_expected_dtype, held_shapes, load_state_dict, random_state_dict


def contiguous_runs(pages: list[int]) -> list[tuple[int, int]]:
    """[3, 4, 5, 9, 10] -> [(3, 6), (9, 11)]: half-open runs, so each run is cleared in one copy."""
    runs: list[tuple[int, int]] = []
    for p in sorted(set(pages)):
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs


class ModelRunner(ABC):
    """One model on one device: weights, pools, and a batched step over paged caches.

    With several ranks a runner is one rank's part of the model (`place`): it loads only the tensors (or
    slices) that rank holds (held_weights), its pools hold the cache groups as that rank stores them
    (cache_specs: tensor parallel keeps only its kv heads), and its steps call the collectives of its
    tensor- and expert-parallel groups (use_collectives; None in a one-process deployment)."""

    def __init__(self, model: ModelSpec, device: torch.device, place: RankPlace | None = None):
        check_model(model)           # ConfigError naming the key path when the model breaks its arch's rules
        self.model = model
        self.device = device
        self.place = place or RankPlace.single()
        self.cache_specs = rank_cache_groups(model, self.place)
        self.tensor_parallel: Collective | None = None
        self.expert_parallel: Collective | None = None
        self.pools: dict[str, torch.Tensor] = {}
        self.num_blocks: dict[str, int] = {}
        self.num_scratch = 0
        # What zero_new_pages clears (each runner names its groups): state_groups' pages every time a step announces
        # them, zero_on_first_use groups' pages the first time (_unzeroed: per page, 1 until then).
        self.state_groups: tuple[str, ...] = ()
        self.zero_on_first_use: frozenset[str] = frozenset()
        self._unzeroed: dict[str, bytearray] = {}

    def use_collectives(self, tensor: Collective | None, expert: Collective | None) -> None:
        """The collectives of this rank's tensor- and expert-parallel groups (set once the ranks have joined)."""
        self.tensor_parallel, self.expert_parallel = tensor, expert

    # -- weights -----------------------------------------------------------------------------------
    @abstractmethod
    def expected_weights(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every parameter the model needs: name -> (shape, dtype). Checkpoints are checked against it."""

    def held_weights(self) -> dict[str, TensorSlice | None]:
        """The checkpoint tensors this rank holds, each whole (None) or its slice: one process holds them all."""
        return dict.fromkeys(self.expected_weights())

    def load_weights(self) -> None:
        """Load model.weights (a checkpoint directory, its config.json checked first) or make seeded random
        weights ("random"), then set them: this rank's tensors only, each read at its slice."""
        if self.model.weights == "random":
            state = self.random_weights(self.model.weights_seed)
        else:
            check_checkpoint_config(self.model.weights, self.model)
            state = load_state_dict(self.model.weights, self.expected_weights(), self.device, held=self.held_weights())
        self.set_weights(state)

    def random_weights(self, seed: int, std: float = 0.02, device: torch.device | str | None = None
                       ) -> dict[str, torch.Tensor]:
        """Seeded random weights of this rank (on `device`, default the runner's): what `weights: random` serves
        and what tiny checkpoints hold. Each tensor's values depend only on its name and the seed, so a rank's
        slice equals the same part of one process's tensor. Runners override it where a tensor needs more than
        random values."""
        return random_state_dict(self.expected_weights(), seed, device or self.device, std, held=self.held_weights())

    def set_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Use these weights: exactly the tensors this rank holds, by name and held shape (any float dtype is cast;
        the bytes of a quantized format stored as uint8 are reinterpreted, see npu.weights.as_expected_dtype)."""
        expected = held_shapes(self.expected_weights(), self.held_weights())
        missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        if missing or extra:
            raise CheckpointError(f"weights for {self.model.name!r}: missing {missing}, unexpected {extra}")
        for name, (shape, _) in expected.items():
            if tuple(state[name].shape) != tuple(shape):
                raise CheckpointError(f"weight {name!r}: expected shape {list(shape)}, got {list(state[name].shape)}")
        self.install_weights({n: as_expected_dtype(t, expected[n][1]).to(self.device) for n, t in state.items()})

    @abstractmethod
    def install_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Hold checked weights (on the device, in their expected dtypes) the way the math wants them."""

    @abstractmethod
    def weight_tensors(self) -> list[torch.Tensor]:
        """Every tensor the runner holds for weights. The CPU's allocation tracker counts them as resident
        during the profile: a step reads only some of them (an MoE's unpicked experts), a device holds all."""

    # -- pools -------------------------------------------------------------------------------------
    def pool_dtype(self, spec: CacheGroupSpec) -> torch.dtype:
        return getattr(torch, spec.row_dtype)

    def allocate_pools(self, num_blocks: Mapping[str, int], num_scratch: int) -> None:
        """Allocate every group's pool: num_blocks[group] pages plus num_scratch scratch pages at the end.

        The pages are not cleared here (torch.empty): zeroing a whole pool touched every byte before serving (an 8 GiB
        CPU budget took 22 s). What a step can read before writing is zeroed instead: now, page 0 (what padding entries
        of a block table name) and the scratch pages (padding rows' and the startup profile's); the rest when a step
        first announces them (zero_new_pages), for the groups that need it."""
        self.free_pools()
        try:
            for spec in self.cache_specs:
                blocks = num_blocks[spec.name]
                pool = self.empty_pool((spec.num_layers, blocks + num_scratch, spec.rows_per_block,
                                        self.row_elements(spec)), self.pool_dtype(spec))
                pool[:, :1].zero_()
                pool[:, blocks:].zero_()
                self.pools[spec.name] = pool
                if spec.name in self.zero_on_first_use:
                    unzeroed = bytearray(b"\1") * blocks    # per page, 1 until zeroed (the scratch pages past blocks
                    if blocks:                               # are, and page 0)
                        unzeroed[0] = 0
                    self._unzeroed[spec.name] = unzeroed
        except Exception:
            self.free_pools()
            raise
        self.num_blocks = dict(num_blocks)
        self.num_scratch = num_scratch

    def empty_pool(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A pool's memory as the device gives it (tests override this to start pools full of NaN); on a CPU, on
        2 MiB pages where the host grants them (npu.huge_pages: asked before the first write)."""
        pool = torch.empty(shape, dtype=dtype, device=self.device)
        advise_huge_pages(pool)
        return pool

    def row_elements(self, spec: CacheGroupSpec) -> int:
        """Elements per row in the pool dtype (extra bytes, e.g. an fp32 scale, are stored inline)."""
        elem = torch.empty((), dtype=self.pool_dtype(spec)).element_size()
        extra = -(-spec.row_extra_bytes // elem)
        return spec.row_width + extra

    def free_pools(self) -> None:
        self.pools.clear()
        self._unzeroed.clear()
        self.num_blocks = {}

    def shutdown(self) -> None:
        """Serving ended: give the pools back."""
        self.free_pools()

    def scratch_page(self, group: str, row: int) -> int:
        """Scratch page of a padding row: padding rows write there, never into a real page."""
        return self.num_blocks[group] + row

    def zero_pages(self, group: str, pages: list[int]) -> None:
        pool = self.pools[group]
        for start, stop in contiguous_runs(pages):
            pool[:, start:stop].zero_()

    def zero_new_pages(self, new_pages: Mapping[str, list[int]]) -> None:
        """Before a step: the announced pages (StepBatch.new_pages) of `state_groups` every time (their rows
        accumulate from zero), those of `zero_on_first_use` groups the first time only (their pools start
        uninitialized, and a read of never-written rows there could reach the math); other groups' pages are left
        as they are (every read of a row never written is masked with torch.where)."""
        for group, pages in new_pages.items():
            if not pages:
                continue
            if group in self.state_groups:
                self.zero_pages(group, pages)
            elif group in self._unzeroed:
                unzeroed = self._unzeroed[group]
                first = [p for p in pages if 0 <= p < len(unzeroed) and unzeroed[p]]
                if first:
                    self.zero_pages(group, first)
                    for p in first:
                        unzeroed[p] = 0

    # -- steps -------------------------------------------------------------------------------------
    # Whether execute takes StepBatch.fed (async scheduling feeds the previous step's sampled ids on the device).
    feeds_tokens = False

    @staticmethod
    def feed_rows(tokens: torch.Tensor, flat_rows: Sequence[int], fed: FedTokens) -> None:
        """Write the fed rows' tokens into a step's token ids on the device (tokens[flat_rows[k]] = source[the k-th fed
        row's index]): one gather and one scatter, no host sync. flat_rows: where each fed row's token is in `tokens`,
        in fed.rows order."""
        device = tokens.device
        at = torch.tensor(list(flat_rows), dtype=torch.long).to(device, non_blocking=True)
        src = torch.tensor([k for _, k in fed.rows], dtype=torch.long).to(device, non_blocking=True)
        tokens.index_copy_(0, at, fed.source.index_select(0, src).to(tokens.dtype))

    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Run one step; return logits [number of seqs with sample=True, vocab], in batch order, in float32 or
        the model's compute dtype (as transformers and vLLM models do: the sampler widens what it reads).

        Two halves: `prepare` on the host, then `forward` on the device. The device half is free of host syncs
        (no `.tolist()`, `.item()`, `bool(t)`, `.cpu()` or data-dependent shapes) and keeps every operand on the
        runner's device, so a GPU or NPU runs it without waiting and it could be captured as a graph;
        tests/npu/test_device_guard.py runs it on fake CUDA tensors, where either mistake fails."""
        inputs = self.prepare(batch)
        self.zero_new_pages(batch.new_pages)
        return self.forward(inputs)

    @abstractmethod
    def prepare(self, batch: StepBatch) -> Any:
        """The host half of a step: check the batch and lay out its indices as host tensors and plain ints (never
        read or make a device tensor's values here). Its result is what `forward` takes."""

    @abstractmethod
    def forward(self, inputs: Any) -> torch.Tensor:
        """The device half: upload `prepare`'s result and run the model; no host sync, no host operand."""

    def execute_partitions(self, batches: Sequence[StepBatch]) -> torch.Tensor:
        """The StepExecutor interface: a runner is one data-parallel rank, so it steps exactly one batch."""
        if len(batches) != 1:
            raise ValueError(f"a runner steps one data-parallel rank's batch, got {len(batches)} batches")
        return self.execute(batches[0])

    def capture_graphs(self, max_batch: int, record: bool, max_model_len: int) -> str | None:
        """Set up decode steps of up to max_batch rows as replayed device graphs (npu/graphs.py), recorded where
        `record`; after the pools exist, since graphs keep their addresses. Returns a line for the startup report,
        or None where the runner has no such path (the default)."""
        return None

    def release_graphs(self) -> None:
        """Drop the decode graphs (before their pools are freed)."""

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """The StepExecutor interface: a runner lives in this process; no other rank can be lost."""

    # -- profiling ---------------------------------------------------------------------------------
    def scratch_batch(self, step: StepShape) -> StepBatch:
        """`step` (one of appliance.core.step_limits.worst_steps) as a batch whose every page is a scratch page:
        the profile computes at full size, and no real page is read or written. Ring groups get their
        max_blocks_per_seq slots, full-history groups one page per logical page up to the sequence's end.
        The batch is marked worst_case: data-dependent paths (MoE routing) take their heaviest branch."""
        if self.num_scratch < 1:
            raise RuntimeError("scratch_batch needs scratch pages: allocate_pools(..., num_scratch >= 1) first")
        seqs = []
        for i, s in enumerate(step.seqs):
            tables = {}
            for spec in self.cache_specs:
                pages = spec.max_blocks_per_seq if spec.is_ring else -(-s.end // spec.tokens_per_page)
                tables[spec.name] = [self.scratch_page(spec.name, (i + j) % self.num_scratch) for j in range(pages)]
            seqs.append(SeqStep(f"{step.name}-{i}", [0] * (s.num_tokens - s.draft_tokens), s.start_pos, tables,
                                num_draft=s.draft_tokens))
        return StepBatch(seqs, worst_case=True, expert_rows=step_rows(seqs))   # every rank profiles the same step
