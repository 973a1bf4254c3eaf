"""The front end's side of the requests in the core: their table, and the output processing that makes their text.

The core sends CoreOutputs (token ids, logprobs, its own finish reasons); this table runs the engine's
OutputProcessor over them, as the in-process engine does on its loop thread: detokenizing, stop strings, hold-back,
usage. States of a request here: submitted (in the table; its request_id taken) -> streaming (known to the
processor from its first CoreOutput) -> finished (its last RequestOutput built: out of the table, its id free).
An abort frees its request_id at once and keeps it in the table until the core's ABORTED output comes back; a stop
string found here finishes it at once, and `stopped` tells the caller to have the core free it (Stop).

Threads: submit / abort on the callers' threads (under the lock); process and fail_all on the receive thread only,
the one user of the processor.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Iterator

from appliance.core.request import FinishReason, RequestError, RequestOutput, SamplingParams
from appliance.core.tokenizer import Tokenizer
from appliance.engine.output import CoreOutput, OutputProcessor, ProcessedOutputs

log = logging.getLogger("appliance.engine.process.client")


class CoreRequest:
    """A request submitted to the core, as the front end holds it: abort() it, or iterate its deltas when it was
    submitted without on_output (as Engine's RequestHandle)."""

    def __init__(self, abort: Callable[["CoreRequest"], None], call: int, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams, on_output: Callable[[RequestOutput], None] | None):
        self._abort = abort                     # the client's abort_request
        self.call = call
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.aborted = False
        self.num_tokens = 0                     # output tokens of its CoreOutputs processed so far
        self.outputs: queue.Queue[RequestOutput] = queue.Queue()
        self.on_output = on_output or self.outputs.put

    @property
    def key(self) -> str:
        """How the core names it: the call id of its Submit."""
        return str(self.call)

    @property
    def seq(self) -> "CoreRequest":
        """What the front ends read a prompt's length from (handle.seq.prompt_token_ids, as on Engine's handle)."""
        return self

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            out = self.outputs.get()
            yield out
            if out.finished:
                return

    def abort(self) -> None:
        """Abort this request (never a later one that reuses its id); its last delta (ABORTED) still comes."""
        self._abort(self)

    def deliver(self, out: RequestOutput) -> None:
        try:
            self.on_output(out)
        except Exception:  # noqa: BLE001 - one front end's callback must not stop every other request's deltas
            log.exception("on_output of request %s failed", self.request_id)


class RequestTable:
    """The requests in the core by call id, their request_ids in use, and the output processor (module docstring)."""

    def __init__(self, tokenizer: Tokenizer):
        self.lock = threading.RLock()
        self._requests: dict[int, CoreRequest] = {}
        self._ids: dict[str, CoreRequest] = {}          # request_id -> the request holding it
        self._processor = OutputProcessor(tokenizer)     # (the receive thread's)

    def add(self, request: CoreRequest) -> None:
        """Take its request_id (RequestError when a live request holds it); call under `lock`."""
        if request.request_id in self._ids:
            raise RequestError("request_id", f"{request.request_id!r} is already in flight")
        self._requests[request.call] = request
        self._ids[request.request_id] = request

    def discard(self, request: CoreRequest) -> None:
        """Forget a request the core refused."""
        with self.lock:
            self._requests.pop(request.call, None)
            self._free_id(request)

    def mark_aborted(self, request: CoreRequest) -> bool:
        """Free its request_id at once; whether an Abort should go to the core (live, not aborted yet)."""
        with self.lock:
            if request.aborted or self._requests.get(request.call) is not request:
                return False
            request.aborted = True
            self._free_id(request)
            return True

    def num_in_flight(self) -> int:
        with self.lock:
            return sum(1 for r in self._requests.values() if not r.aborted)

    def process(self, items: list[CoreOutput]) -> tuple[ProcessedOutputs, dict[int, int]]:
        """The RequestOutputs of the core's news (those of requests already finished here are dropped: tokens the
        core computed past a stop string), and the calls a stop string ended, for the core to free, with the output
        tokens each delivered."""
        with self.lock:
            live = [(self._requests.get(int(item.request_id)), item) for item in items]
        processed, finished = ProcessedOutputs(), {}
        for request, item in live:
            if request is None or request.call in finished:     # finished here already (a stop string) or before
                continue
            self._track(request)
            one = self._processor.process_outputs([item])
            processed.outputs += one.outputs
            for key, kept in one.stopped.items():
                processed.stopped[key] = request.num_tokens + kept
            request.num_tokens += len(item.new_token_ids)
            if item.request_id not in self._processor:
                finished[request.call] = request
        with self.lock:
            for request in finished.values():
                self._requests.pop(request.call, None)
                self._free_id(request)
        return processed, {int(key): kept for key, kept in processed.stopped.items()}

    def fail_all(self, error: str | None) -> ProcessedOutputs:
        """The core is gone: every request left ends ABORTED with `error` (usage: what was streamed)."""
        with self.lock:
            requests, self._requests, self._ids = list(self._requests.values()), {}, {}
        for request in requests:
            self._track(request)
        return self._processor.process_outputs(
            CoreOutput(r.key, finish_reason=FinishReason.ABORTED, error=error) for r in requests)

    def _track(self, request: CoreRequest) -> None:
        """Make sure the processor knows the request (from its first CoreOutput on: the receive thread's)."""
        if request.key not in self._processor:
            self._processor.add_request(request.key, request.prompt_token_ids, request.params, request.deliver,
                                        name=request.request_id)

    def _free_id(self, request: CoreRequest) -> None:
        if self._ids.get(request.request_id) is request:
            del self._ids[request.request_id]
