"""A rank that is not the owner: its process from start to stop, and the step loop it runs.

The owner (rank 0) holds the scheduler, the KV-cache manager and the front ends; every other rank holds its
device, its shard of the model and its own pools, and executes what the owner sends: one StepBatch per
data-parallel rank each step (it runs its own data rank's, possibly empty: expert-parallel ranks step in
lockstep), until the owner says stop. `run_step` is the one step both sides run.

A worker's process is spawned by the owner on one host (`python -m npu.worker`, spawned_rank) or started by torchrun (the CLI calls
`run_rank` for RANK != 0). While serving it beats (npu/liveness.py), so that the owner finds it hung when it stops
stepping. Exit status: 0 after the owner's stop, 2 after a startup failure (this rank's or another's, named), 1
when a step fails while serving (the owner's next collective then fails too), when the owner gives up on the
ranks (a peer hung), or when the owner is gone.
"""

from __future__ import annotations

import logging
import pickle
import signal
import sys
from typing import Callable, Sequence

import torch

from appliance.core.config import RuntimeConfig
from appliance.core.errors import StartupError
from appliance.core.parallel import place_of, world_size
from npu.launcher import launch, prepare_rank
from npu.leaving import leave_process
from npu.liveness import Heartbeat, beat_interval, exit_with_parent
from npu.ranks import RankGroup, Rendezvous, StartupBoard, connect_store
from npu.runner import ModelRunner
from npu.step import StepBatch, draft_rows, logits_offsets

log = logging.getLogger("npu.worker")

STOP = "stop"            # the owner's last message
EXIT_STARTUP = 2
EXIT_STEP_FAILED = 1


def run_step(runner: ModelRunner, group: RankGroup, batches: Sequence[StepBatch]) -> torch.Tensor | None:
    """This rank's share of one step: its data-parallel rank's batch. With several data-parallel ranks, every
    rank's sampled logits are then gathered, in data-rank order, on rank 0 (None on the others)."""
    logits = runner.execute(batches[group.place.data_rank])
    if group.place.data == 1:
        return logits
    counts = [sum(len(logits_offsets(s)) for s in b.seqs) + draft_rows(b.seqs) for b in batches]
    if not any(counts):
        return logits if group.rank == 0 else None
    return group.gather_rows(logits, counts)


def serve_steps(runner: ModelRunner, group: RankGroup, heartbeat: Heartbeat) -> None:
    """Execute the owner's steps until it sends STOP, counting them in the heartbeat."""
    while True:
        message = group.receive()
        if message == STOP:
            return
        heartbeat.step_received()
        run_step(runner, group, message)
        heartbeat.step_finished()


def abandon(rank: int) -> Callable[[str], None]:
    """What a rank's heartbeat does when the owner gives up on the ranks or is gone: leave at once, exit 1 (its
    main thread may be blocked in a collective with a hung peer, which no timeout ends while serving)."""
    def leave(reason: str) -> None:
        log.error("rank %d exits: %s", rank, reason)
        leave_process(EXIT_STEP_FAILED)
    return leave


def run_rank(rc: RuntimeConfig, rdv: Rendezvous) -> int:
    """A non-owner rank from start to stop; returns its exit status (module docstring)."""
    place = place_of(rc.parallel, rdv.rank)
    try:
        rdv.check_world(world_size(rc.parallel))
        board = StartupBoard(connect_store(rdv, rc.parallel.startup_timeout_s), rdv.rank, rdv.world)
        board.mark("preflight")
        try:
            backend, runner = prepare_rank(rc, place, rdv.local_rank)
        except Exception as exc:
            raise board.failed("preflight", exc) from exc
        group = RankGroup(place, board, backend.torch_device(0).type, rc.parallel.startup_timeout_s)
        runner, _ = launch(rc, backend, runner, group)
    except StartupError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_STARTUP
    heartbeat = Heartbeat(board.store, rdv.rank, beat_interval(rc.parallel.step_timeout_s), abandon(rdv.rank))
    heartbeat.start()
    try:
        serve_steps(runner, group, heartbeat)
    except Exception:      # the others are out of lockstep now: leave without a goodbye collective
        log.exception("rank %d: a step failed; this rank stops", rdv.rank)
        heartbeat.stop(EXIT_STEP_FAILED)
        return EXIT_STEP_FAILED
    heartbeat.stop(0)
    runner.shutdown()
    group.close()
    return 0


def spawned_rank(argv: list[str]) -> int:
    """`python -m npu.worker RANK WORLD PORT PARENT_PID` with the pickled RuntimeConfig on stdin: the process of
    a rank the owner (PARENT_PID) spawned on this host, its device the local index RANK. Logs warnings and errors
    only (the owner logs the startup), each line naming the rank. It ends when the owner says stop, when the
    owner is gone, or when the owner kills it (LocalRanks.stop), not on a signal meant for the owner."""
    rank, world, port, parent = (int(a) for a in argv)
    rc: RuntimeConfig = pickle.load(sys.stdin.buffer)
    for sig in (signal.SIGINT, signal.SIGTERM):          # sent to the whole process group (Ctrl-C, a service
        signal.signal(sig, signal.SIG_IGN)              # manager): the owner drains, then stops every rank
    exit_with_parent(parent)
    level = logging.DEBUG if rc.logging.level == "DEBUG" else logging.WARNING
    logging.basicConfig(level=level, format=f"[rank {rank}][%(name)s][%(levelname)s] %(message)s")
    return run_rank(rc, Rendezvous(rank, world, rank, "127.0.0.1", port))


if __name__ == "__main__":
    leave_process(spawned_rank(sys.argv[1:]))
