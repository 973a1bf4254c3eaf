"""Offline Python API: `Appliance.from_config(...).generate(prompts, sampling)`."""

from __future__ import annotations

import atexit
import itertools
import threading
from typing import Callable, Sequence

from appliance.config.compose import load_runtime_config
from appliance.core.config import RuntimeConfig
from appliance.core.request import CompletionResult, RequestOutput, SamplingParams
from appliance.core.startup_report import StartupReport
from appliance.engine.engine import Engine

_ids = itertools.count()


class Appliance:
    """An engine started in-process. Use as a context manager, or call close()."""

    def __init__(self, rc: RuntimeConfig):
        self.rc = rc
        self.engine = Engine(rc)
        self.report: StartupReport = self.engine.start()
        # A program that ends without close() still stops the engine before the interpreter tears down: with its
        # loop thread (and that thread's OpenMP team) left running while the native libraries shut down, such a
        # process sometimes ended in "terminate called without an active exception", exit status 134.
        atexit.register(self.close)

    @classmethod
    def from_config(cls, config: RuntimeConfig | Sequence[str] | None = None) -> "Appliance":
        """A RuntimeConfig, or Hydra-style overrides such as ["+model=qwen3_tiny", "max_num_seqs=32"]."""
        rc = config if isinstance(config, RuntimeConfig) else load_runtime_config(list(config or []))
        return cls(rc)

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams()) -> list[CompletionResult]:
        """Submit every prompt at once (continuous batching) and return results in prompt order."""
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        collector = _Collector(len(prompts))
        results = []
        for prompt, p in zip(prompts, params):
            request_id = f"offline-{next(_ids)}"
            prompt_ids = list(prompt) if not isinstance(prompt, str) else self.engine.tokenizer.encode(prompt)
            result = CompletionResult(request_id, prompt_ids)
            self.engine.submit(request_id, prompt_ids, p, collector.on_output(result))
            results.append(result)
        collector.wait()
        failed = next((r for r in results if r.request_id in collector.errors), None)
        if failed is not None:
            raise RuntimeError(f"request {failed.request_id} failed in the engine: {collector.errors[failed.request_id]}")
        return results

    def close(self) -> None:
        atexit.unregister(self.close)
        self.engine.shutdown()

    def __enter__(self) -> "Appliance":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Collector:
    """Fills each CompletionResult from the engine loop's callbacks and wakes the caller once all finished.

    Why callbacks rather than each request's output queue: the loop thread appends a token to a list in place,
    where a queue would hand every token of every request to the caller's thread (a lock, a wake-up and the
    GIL passed back and forth per token)."""

    def __init__(self, num_requests: int):
        self.remaining = num_requests
        self.errors: dict[str, str] = {}
        self.done = threading.Event()
        if num_requests == 0:
            self.done.set()

    def on_output(self, result: CompletionResult) -> Callable[[RequestOutput], None]:
        def collect(out: RequestOutput) -> None:      # runs on the engine loop thread
            result.token_ids.extend(out.new_token_ids)
            result.text += out.new_text
            result.logprobs.extend(out.logprobs or ())
            result.prompt_logprobs.extend(out.prompt_logprobs or ())
            if out.finished:
                result.finish_reason, result.usage = out.finish_reason, out.usage
                if out.error:
                    self.errors[result.request_id] = out.error
                self.remaining -= 1
                if self.remaining == 0:
                    self.done.set()
        return collect

    def wait(self) -> None:
        self.done.wait()
