"""Ranks on torch.distributed: the rendezvous, the process groups, and startup phases every rank agrees on.

One process per device. The rendezvous is a TCPStore: hosted by the owner (rank 0) when the appliance spawns
its ranks on one host, or found through torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT: env://) across hosts. Over it, each rank joins:

    the world group    the device's backend (gloo on CPU, nccl on CUDA, hccl on Ascend): tensor collectives,
                       with the startup timeout
    tensor / expert    subgroups of neighbouring ranks (appliance.core.parallel), for a runner's all-reduce
                       and all-to-all; the world group itself when one spans every rank
    control            gloo, the startup timeout: the owner's startup agreements (objects)
    steps              gloo, no practical timeout: the owner sends each step; an idle owner may wait for hours

Startup runs as phases (`RankGroup.phase`). A rank whose phase fails writes the error to the store under its
rank and raises RankStartupError naming itself; its process then exits at once, so peers waiting in a
collective with it see the connection close instead of waiting for a timeout. The other ranks then read
the store and raise the same error naming the failed rank, so every rank ends with exit status 2 and one
message that says which rank failed and why. A rank that never arrives is caught by the timeouts: the
rendezvous and every startup collective wait at most parallel.startup_timeout_s, then name the ranks that
were not there (each rank marks the phase it reached in the store).
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

import torch
import torch.distributed as dist

from appliance.core.errors import StartupError
from appliance.core.parallel import RankPlace
from npu.collectives import Collective

log = logging.getLogger("npu.ranks")

T = TypeVar("T")

PROCESS_GROUP_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
STEP_WAIT = datetime.timedelta(days=3650)   # workers wait for the owner's next step this long (an idle server)
ERROR_GRACE_S = 5.0                         # a peer's error reaches the store before its connection closes
JOIN_POLL_S = 0.2                           # while joining, how often the board is read for early failures
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class RankStartupError(StartupError, RuntimeError):
    """A rank failed at startup (or never arrived); every rank raises this, naming it. The CLI exits 2."""


@dataclass(frozen=True)
class Rendezvous:
    """How this process meets the others: its rank, the world size, its device on its host, and the store."""

    rank: int
    world: int
    local_rank: int
    host: str
    port: int
    from_torchrun: bool = False

    @classmethod
    def from_environment(cls) -> Rendezvous | None:
        """torchrun's ranks (env://), or None when this process was not started by torchrun."""
        if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
            return None
        missing = [v for v in TORCHRUN_VARS if v not in os.environ]
        if missing:
            raise RankStartupError(f"torchrun's environment is incomplete: {', '.join(missing)} not set "
                                   f"(RANK and WORLD_SIZE are). Fix: start the ranks with torchrun")
        env = os.environ
        return cls(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]), env["MASTER_ADDR"],
                   int(env["MASTER_PORT"]), from_torchrun=True)

    def check_world(self, expected: int) -> None:
        """The config's world (tensor x data parallel) must be the number of ranks torchrun started."""
        if self.world != expected:
            raise RankStartupError(
                f"rank {self.rank}: torchrun started WORLD_SIZE={self.world} ranks but the config describes "
                f"{expected} (parallel.tensor_parallel_size x parallel.data_parallel_size = device.count). Fix: "
                f"device.count={self.world} with matching parallel.* sizes, or start {expected} ranks")


def owner_rendezvous() -> tuple[int, int]:
    """(rank, local device index) of this process before any rendezvous: torchrun's, or the owner's (0, 0)."""
    rdv = Rendezvous.from_environment()
    return (0, 0) if rdv is None else (rdv.rank, rdv.local_rank)


def host_store(world: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store the owner hosts for the ranks it spawns (loopback, a free port)."""
    return dist.TCPStore("127.0.0.1", 0, world, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def connect_store(rdv: Rendezvous, timeout_s: float) -> dist.Store:
    """The rendezvous store from this rank: torchrun's (env://, which knows whether its agent hosts it), or the
    owner's at host:port."""
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if rdv.from_torchrun:
            store, _, _ = next(dist.rendezvous("env://", rdv.rank, rdv.world, timeout=timeout))
            return store
        return dist.TCPStore(rdv.host, rdv.port, rdv.world, False, timeout=timeout)
    except (RuntimeError, ValueError) as exc:
        raise RankStartupError(f"rank {rdv.rank}: cannot reach the rendezvous at {rdv.host}:{rdv.port} within "
                               f"{timeout_s:g} s ({first_line(exc)}). Fix: start rank 0 (it hosts the group), check "
                               f"MASTER_ADDR / MASTER_PORT and the network between hosts") from None


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def describe_failure(exc: BaseException) -> str:
    """A StartupError's own message (it names the key, file or device and the fix); anything else with its type."""
    return str(exc) if isinstance(exc, StartupError) else f"{type(exc).__name__}: {exc}"


class StartupBoard:
    """The startup keys of the rendezvous store: the phase each rank reached, and the error a failed rank left
    (written before its connections close, so a peer whose collective broke can say which rank failed)."""

    def __init__(self, store: dist.Store, rank: int, world: int):
        self.root = store                    # the process groups rendezvous over it too, under their own prefix
        self.store = dist.PrefixStore("appliance", store)
        self.rank, self.world = rank, world

    def mark(self, phase: str) -> None:
        self.store.set(f"phase/{self.rank}", phase)

    def failed(self, phase: str, exc: BaseException) -> RankStartupError:
        """This rank failed in `phase`: log it, leave the error for the others, and return the error to raise."""
        message = describe_failure(exc)
        log.error("rank %d failed at startup (%s): %s", self.rank, phase, message)
        try:
            self.store.set(f"error/{self.rank}", f"{phase}: {message}")
        except (RuntimeError, ValueError):
            pass                             # the store host is gone: this rank's own output still names it
        return RankStartupError(f"rank {self.rank} failed at startup ({phase}): {message}")

    def errors(self, wait: bool) -> str:
        """The startup errors other ranks left ('' when none), waiting up to ERROR_GRACE_S for one to appear."""
        deadline = time.monotonic() + (ERROR_GRACE_S if wait else 0.0)
        while True:
            try:
                found = {r: self.store.get(f"error/{r}").decode() for r in range(self.world)
                         if r != self.rank and self.store.check([f"error/{r}"])}
            except (RuntimeError, ValueError):
                return ""                    # the store host is gone
            if found or time.monotonic() >= deadline:
                return "; ".join(f"rank {r} failed at startup ({e})" for r, e in sorted(found.items()))
            time.sleep(0.1)

    def phases(self) -> dict[int, str]:
        """The phase every other rank reached ('not started' for one that never wrote)."""
        return {r: self.store.get(f"phase/{r}").decode() if self.store.check([f"phase/{r}"]) else "not started"
                for r in range(self.world) if r != self.rank}


class RankGroup:
    """This process's membership in the ranks: its place, the process groups, and the startup agreement.

    Joining (init_process_group and the subgroups) runs in a helper thread while this one watches the board
    (and `watch`, e.g. the spawned processes' exit codes), so a rank that failed before it could join ends the
    wait at once, naming it, instead of after the timeout."""

    def __init__(self, place: RankPlace, board: StartupBoard, device_type: str, timeout_s: float,
                 watch: Callable[[], str] | None = None):
        self.place = place
        self.rank, self.world = place.rank, place.world
        self.board = board
        self.timeout_s = timeout_s
        self.backend = PROCESS_GROUP_BACKENDS.get(device_type, "gloo")
        self.board.mark("joining")
        joined = threading.Event()
        failure: list[BaseException] = []

        def join() -> None:
            try:
                self._join(board.root, datetime.timedelta(seconds=timeout_s))
            except BaseException as exc:   # noqa: BLE001 - handed to the watching thread
                failure.append(exc)
            finally:
                joined.set()

        threading.Thread(target=join, name="rank-join", daemon=True).start()
        while not joined.wait(JOIN_POLL_S):
            problem = board.errors(wait=False) or (watch() if watch is not None else "")
            if problem:
                raise RankStartupError(problem)
        if failure:
            raise self.peer_failure("joining", failure[0])
        self.board.mark("joined")

    def _join(self, store: dist.Store, timeout: datetime.timedelta) -> None:
        dist.init_process_group(self.backend, store=dist.PrefixStore("world", store), rank=self.rank,
                                world_size=self.world, timeout=timeout)
        self.control = None if self.backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
        self.steps = dist.new_group(backend="gloo", timeout=STEP_WAIT)
        tensor, expert = self._subgroups(self.place.tensor, timeout), self._subgroups(self.place.expert, timeout)
        # What a runner's steps call: None where this rank's group is itself alone.
        self.tensor = None if tensor is None else Collective(tensor, self.place.tensor, self.place.tensor_rank)
        self.expert = None if expert is None else Collective(expert, self.place.expert, self.place.expert_rank)

    def _subgroups(self, size: int, timeout: datetime.timedelta) -> Any:
        """This rank's group of `size` neighbouring ranks (every rank creates all of them, in one order), the
        world group when it spans every rank, None for a group of one."""
        if size == 1:
            return None
        if size == self.world:
            return dist.group.WORLD
        mine = None
        for first in range(0, self.world, size):
            group = dist.new_group(list(range(first, first + size)), backend=self.backend, timeout=timeout)
            if first <= self.rank < first + size:
                mine = group
        return mine

    # -- startup agreement -------------------------------------------------------------------------
    def phase(self, name: str, fn: Callable[[], T]) -> T:
        """Run one startup phase on this rank, then agree with every rank that all of them finished it."""
        self.board.mark(name)
        try:
            result = fn()
        except Exception as exc:
            if not isinstance(exc, StartupError):     # perhaps a collective that lost a failed peer
                peers = self.board.errors(wait=True)
                if peers:
                    raise RankStartupError(peers) from None
            raise self.board.failed(name, exc) from exc
        self.all_gather(name, True)
        return result

    def all_gather(self, phase: str, obj: Any) -> list[Any]:
        """`obj` from every rank, in rank order (a startup collective: it times out, naming who is missing)."""
        self.board.mark(phase)
        out: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(out, obj, group=self.control)
        except (RuntimeError, ValueError) as exc:
            raise self.peer_failure(phase, exc) from None
        return out

    def peer_failure(self, phase: str, exc: BaseException) -> RankStartupError:
        """Why a startup collective failed: the errors failed ranks left in the store, else the ranks that never
        reached this phase, else the collective's own error."""
        try:
            errors = self.board.errors(wait=True)
            behind = self.board.phases()
        except (RuntimeError, ValueError):
            return RankStartupError(f"rank {self.rank}: the ranks' store is gone during {phase} (rank 0 hosts it "
                                    f"and has ended; its output says why): {first_line(exc)}")
        if errors:
            return RankStartupError(errors)
        missing = {r: p for r, p in behind.items() if p != phase}
        if missing:
            where = ", ".join(f"rank {r} is at '{p}'" for r, p in sorted(missing.items()))
            return RankStartupError(f"rank {self.rank}: not every rank reached '{phase}' within "
                                    f"parallel.startup_timeout_s={self.timeout_s:g} s ({where}): {first_line(exc)}. "
                                    f"Fix: look at those ranks' output; raise parallel.startup_timeout_s if they are "
                                    f"only slow")
        return RankStartupError(f"rank {self.rank}: a startup collective failed during {phase}: {first_line(exc)}")

    # -- steps -------------------------------------------------------------------------------------
    def send(self, message: Any) -> None:
        """The owner (rank 0) sends every rank the next step (or the stop)."""
        dist.broadcast_object_list([message], src=0, group=self.steps)

    def receive(self) -> Any:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.steps)
        return box[0]

    def gather_rows(self, rows: torch.Tensor, counts: Sequence[int]) -> torch.Tensor | None:
        """Each data-parallel rank's rows (counts[d] of them from data rank d), in data-rank order, on rank 0
        (None elsewhere). Every rank contributes (tensor-parallel ranks of one data rank hold equal rows)."""
        widest = max(counts)
        padded = rows.new_zeros((widest, *rows.shape[1:]))
        padded[:rows.shape[0]] = rows
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded)
        if self.rank != 0:
            return None
        tp = self.place.tensor
        return torch.cat([parts[d * tp][:n] for d, n in enumerate(counts)])

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
