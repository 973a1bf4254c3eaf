"""An engine stand-in for server tests: the engine's interface (appliance/engine/engine.py) with a byte-level
tokenizer, a step thread and per-request block accounting, so every fault path of the server runs in-process in a
few seconds. Requests are validated by the engine's own `validate_request`."""

from __future__ import annotations

import dataclasses
import threading
import time
import types

from appliance.core.planner import DeviceMemory, plan_capacity
from appliance.core.request import (
    EngineUnavailableError,
    FinishReason,
    QueueFullError,
    RequestError,
    RequestLimits,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
    Usage,
    validate_request,
)
from appliance.core.startup_report import StartupReport
from appliance.engine.stats import EngineStats, GroupUsage


class ByteTokenizer:
    eos_token_id = 0
    max_token_bytes = 1

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids) -> str:
        return bytes(ids).decode(errors="replace")

    def token_to_id(self, token: str) -> int | None:
        """No special tokens: no marker is one token."""
        return None


class FakeHandle:
    def __init__(self, engine: "FakeEngine", request_id: str, prompt_ids: list[int]):
        self._engine, self.request_id = engine, request_id
        self.seq = types.SimpleNamespace(prompt_token_ids=tuple(prompt_ids))     # as the engine's handle has it

    def abort(self) -> None:
        self._engine.abort(self.request_id)


def fake_token(prompt: list[int], i: int) -> int:
    """Token i of a fake completion: printable bytes derived from the prompt."""
    return 97 + (sum(prompt) + 7 * i) % 26


@dataclasses.dataclass
class FakeRequest:
    rid: str
    prompt: list[int]
    params: SamplingParams
    on_output: object
    produced: int = 0


def fake_logprobs(req: "FakeRequest", tok: int) -> dict:
    """The logprobs fields of the delta of the req's newest token, as the engine fills them: generated tokens at
    logprob -1 (rank 1), prompt tokens at -2 (rank 2, behind token 0 at -0.5)."""
    fields: dict = {}
    if req.params.logprobs is not None:
        fields["logprobs"] = (TokenLogprob(tok, -1.0, 1, ((tok, -1.0),) * min(req.params.logprobs, 1)),)
    if req.params.prompt_logprobs is not None and req.produced == 1:
        fields["prompt_token_ids"] = tuple(req.prompt)
        top = ((0, -0.5),) * min(req.params.prompt_logprobs, 1)           # token 0 is more likely
        fields["prompt_logprobs"] = (None, *(TokenLogprob(t, -2.0, 2, top) for t in req.prompt[1:]))
    return fields


class FakeEngine:
    """Engine stand-in. start_gate / drain_gate hold start() / drain() until set; a prompt "boom" fails. With
    `reply`, every request answers that text, one character per step (its UTF-8 bytes as the token ids), and
    stops at its end (finish reason stop) unless max_tokens comes first."""

    VOCAB = 256

    def __init__(self, rc, *, step_s: float = 0.002, max_requests: int = 64, start_gate=None, drain_gate=None,
                 start_error: BaseException | None = None, reply: str | None = None):
        self.rc, self.step_s, self.max_requests, self.start_error = rc, step_s, max_requests, start_error
        self.reply = reply
        self.start_gate, self.drain_gate = start_gate, drain_gate
        self.tokenizer = ByteTokenizer()
        self.limits = RequestLimits(self.VOCAB, rc.max_model_len, self.tokenizer.max_token_bytes)
        self.report: StartupReport | None = None
        self.requests: dict[str, FakeRequest] = {}
        self.aborted: list[str] = []
        self.draining = False
        self.drain_calls: list[float] = []
        self.shutdown_called = False
        self.failure: str | None = None               # the engine's: it never stops on its own
        self.on_failure = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._free: dict[str, int] = {}
        self._total: dict[str, int] = {}

    def prepare(self) -> None:
        """No files and no device to check (serve() calls this before binding)."""

    def start(self) -> StartupReport:
        if self.start_gate is not None:
            self.start_gate.wait(30)
        if self.start_error is not None:
            raise self.start_error
        specs = self.rc.model.cache_groups
        dev = DeviceMemory("cpu:0", 1 << 30, 1 << 30, 100 << 20)
        plan = plan_capacity(specs, [dev], utilization=self.rc.npu_memory_utilization,
                             decode_batch=self.rc.decode_batch, max_model_len=self.rc.max_model_len,
                             block_size=self.rc.block_size, num_slots_override=4)
        self._total = dict(plan.num_blocks)
        self._free = dict(plan.num_blocks)
        self.report = StartupReport(self.rc.model.name, self.rc.model.arch, "cpu", 1, plan, self.rc.resolved_yaml,
                                    "random (seed 0)", notes=("fake engine",))
        threading.Thread(target=self._loop, daemon=True).start()
        return self.report

    def kv_free_blocks(self) -> dict[str, int]:
        with self._lock:
            return dict(self._free)

    def kv_total_blocks(self) -> dict[str, int]:
        return dict(self._total)

    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(num_running=len(self.requests),
                               groups=tuple(GroupUsage(g, self._total[g], self._free[g]) for g in self._total))

    def submit(self, request_id, prompt, params, on_output=None):
        if self.report is None or self.draining:
            raise EngineUnavailableError("starting" if self.report is None else "draining")
        ids = validate_request(request_id, prompt, params, self.limits, self.tokenizer.encode)  # the engine's own
        with self._lock:
            if request_id in self.requests:
                raise RequestError("request_id", f"{request_id!r} is already in flight")
            if len(self.requests) >= self.max_requests:
                raise QueueFullError(f"{self.max_requests} requests waiting")
            for g in self._free:            # one block per group per request, enough to see leaks
                self._free[g] -= 1
            self.requests[request_id] = FakeRequest(request_id, ids, params, on_output)
        return FakeHandle(self, request_id, ids)

    def _finish(self, req: FakeRequest, reason: FinishReason, error: str | None = None) -> RequestOutput:
        with self._lock:
            self.requests.pop(req.rid, None)
            for g in self._free:
                self._free[g] += 1
        return RequestOutput(req.rid, (), "", reason, Usage(len(req.prompt), req.produced, 0), error)

    def abort(self, request_id: str) -> None:
        with self._lock:
            req = self.requests.get(request_id)
        if req is not None:
            self.aborted.append(request_id)
            req.on_output(self._finish(req, FinishReason.ABORTED))

    def _loop(self) -> None:
        while not self._stop.wait(self.step_s):
            with self._lock:
                live = list(self.requests.values())
            for req in live:
                if req.prompt == list(b"boom") and req.produced == 1:
                    req.on_output(self._finish(req, FinishReason.ABORTED, error="injected kernel failure"))
                    continue
                if self.reply is not None:
                    self._reply_step(req)
                    continue
                tok = fake_token(req.prompt, req.produced)
                req.produced += 1
                if req.produced >= req.params.max_tokens:
                    out = self._finish(req, FinishReason.LENGTH)
                    req.on_output(dataclasses.replace(out, new_token_ids=(tok,), new_text=chr(tok),
                                                      **fake_logprobs(req, tok)))
                else:
                    req.on_output(RequestOutput(req.rid, (tok,), chr(tok), **fake_logprobs(req, tok)))

    def _reply_step(self, req: FakeRequest) -> None:
        char = self.reply[req.produced]
        req.produced += 1
        ids, done = tuple(char.encode()), req.produced == len(self.reply) or req.produced >= req.params.max_tokens
        if done:
            reason = FinishReason.STOP if req.produced == len(self.reply) else FinishReason.LENGTH
            req.on_output(dataclasses.replace(self._finish(req, reason), new_token_ids=ids, new_text=char))
        else:
            req.on_output(RequestOutput(req.rid, ids, char))

    def drain(self, grace_s: float) -> None:
        self.draining = True
        self.drain_calls.append(grace_s)
        if self.drain_gate is not None:
            self.drain_gate.wait(30)
        deadline = time.monotonic() + grace_s
        while self.requests and time.monotonic() < deadline:
            time.sleep(0.005)
        for rid in list(self.requests):
            self.abort(rid)

    def shutdown(self) -> None:
        self.shutdown_called = True
        self._stop.set()


def fail_submit(engine: FakeEngine, prompt: str, exc: Exception) -> None:
    """From now on engine.submit raises `exc` for `prompt` (a fault inside submit that is no refusal)."""
    submit = engine.submit

    def failing(request_id, prompt_or_ids, params, on_output=None):
        if prompt_or_ids == prompt:
            raise exc
        return submit(request_id, prompt_or_ids, params, on_output)
    engine.submit = failing
