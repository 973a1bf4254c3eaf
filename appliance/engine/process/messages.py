"""What the front-end process and the engine core process say to each other: msgspec Structs, MessagePack on ZMQ.

Two sockets, one per direction (appliance/engine/process/client.py binds both, the core connects):

    front -> core   commands    Prepare, Start, Submit, Abort, Stop, Drain, Shutdown; each carries a call id, and
                                every one but Abort and Stop is answered by a Reply with the same id
    core -> front   events      Outputs (the CoreOutputs of one or more engine steps, in order: token ids,
                                logprobs, the core's finish reasons; no text), Reply, Stats (a new
                                snapshot, sent when it changed, and always just before Outputs that finish
                                a request: the front's figures never lag an answer it delivered), Beat (nothing else went out for a while: alive),
                                Failed (the engine stopped for good: a rank died)

A request is named on the wire by the call id of its Submit, never by its request_id: a client may reuse a
request_id as soon as its call ends, and an abort must reach this request, not a later one holding the same id. The
core never sees request_ids: its Engine admits each request under str(call id), the CoreOutputs' request_id. The
front end detokenizes and finds stop strings (appliance.engine.output.OutputProcessor); a stop string it finds ends
the request there at once and is sent to the core as Stop, which frees the request's blocks and counts it STOP.
Events go out on one socket from one thread in the order they happened, so a Reply to Drain arrives after every
delta the drain streamed. The payload types (CoreOutput, SamplingParams, StartupReport, EngineStats) are the
engine's own frozen dataclasses, which msgspec encodes and decodes as they are: no second copy of them here.
"""

from __future__ import annotations

from typing import Union

import msgspec

from appliance.core.request import SamplingParams
from appliance.core.startup_report import StartupReport
from appliance.engine.output import CoreOutput
from appliance.engine.stats import EngineStats

# -- front -> core ---------------------------------------------------------------------------------------------


class Prepare(msgspec.Struct, tag=True, frozen=True):
    """Run the preflight (appliance.engine.preflight: files, backend, runner, tokenizer); answered with Prepared."""

    call: int


class Start(msgspec.Struct, tag=True, frozen=True):
    """Start the engine (weights, profile, plan, allocate, loop); answered with the StartupReport."""

    call: int


class Submit(msgspec.Struct, tag=True, frozen=True):
    """A request the front end has validated and tokenized; the core admits it (or refuses: queue full...)."""

    call: int
    prompt_token_ids: list[int]
    params: SamplingParams


class Abort(msgspec.Struct, tag=True, frozen=True):
    """Abort the request of Submit `call` (nothing when it has finished); its last delta still comes back."""

    call: int


class Stop(msgspec.Struct, tag=True, frozen=True):
    """The front end's output processor ended the request of Submit `call` on a stop string (its stream is over):
    the core finishes it STOP, unless a core rule finished it first; nothing more comes back for it. `kept`: the
    output tokens the front end delivered (the core counts only those as generated, as the in-process engine does)."""

    call: int
    kept: int | None = None


class Drain(msgspec.Struct, tag=True, frozen=True):
    """Stop admitting, let in-flight requests finish for up to grace_s, abort the rest (Engine.drain)."""

    call: int
    grace_s: float


class Shutdown(msgspec.Struct, tag=True, frozen=True):
    """Shut the engine down and end the core process once the Reply is out."""

    call: int


Command = Union[Prepare, Start, Submit, Abort, Stop, Drain, Shutdown]

# -- core -> front ---------------------------------------------------------------------------------------------


class Fault(msgspec.Struct, frozen=True):
    """An exception raised in the core, as the front end re-raises it (faults.fault_error): `kind` picks the type,
    `message` is its text (for a startup fault the whole user-facing message), `field` a RequestError's field."""

    kind: str            # startup | request | queue_full | unavailable | error
    message: str
    type_name: str = ""  # the class raised in the core (a StartupError subclass keeps its name: sweeps classify it)
    field: str | None = None
    type_module: str = ""  # that class's module (a startup fault re-raised here names it as the core did)
    traceback: str = ""    # the core's traceback (HYDRA_FULL_ERROR=1 shows it as the cause of the re-raised fault)


class Prepared(msgspec.Struct, frozen=True):
    """What the preflight decided that the front end needs: the CPUs left to it (the core pinned its threads to the
    others; empty: nothing pinned) and the engine's intra-op threads."""

    front_cpus: list[int]
    core_cpus: list[int]
    threads: int


class Reply(msgspec.Struct, tag=True, frozen=True):
    call: int
    error: Fault | None = None
    report: StartupReport | None = None      # to Start
    prepared: Prepared | None = None         # to Prepare


class Outputs(msgspec.Struct, tag=True, frozen=True):
    """CoreOutputs in the order the engine emitted them (request_id: the call id of the request's Submit)."""

    items: list[CoreOutput]


class Stats(msgspec.Struct, tag=True, frozen=True):
    stats: EngineStats


class Beat(msgspec.Struct, tag=True, frozen=True):
    """Sent when nothing else went out for a beat interval: the core's process is alive and not stopped (the front
    end declares it hung after parallel.step_timeout_s without any event, as the owner does a silent rank)."""


class Failed(msgspec.Struct, tag=True, frozen=True):
    """The engine stopped for good (Engine.on_failure: a rank died); its requests fail with it next."""

    message: str


Event = Union[Outputs, Reply, Stats, Beat, Failed]


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def command_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(Command)


def event_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(Event)
