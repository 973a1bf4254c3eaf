"""Offline Python API: `Appliance.from_config(...).generate(prompts, sampling)`."""

from __future__ import annotations

import itertools
from typing import Sequence

from appliance.config.compose import load_runtime_config
from appliance.core.config import RuntimeConfig
from appliance.core.request import CompletionResult, SamplingParams
from appliance.core.startup_report import StartupReport
from appliance.engine.loop import Engine

_ids = itertools.count()


class Appliance:
    """An engine started in-process. Use as a context manager, or call close()."""

    def __init__(self, rc: RuntimeConfig):
        self.rc = rc
        self.engine = Engine(rc)
        self.report: StartupReport = self.engine.start()

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
        handles, results = [], []
        for prompt, p in zip(prompts, params):
            request_id = f"offline-{next(_ids)}"
            prompt_ids = list(prompt) if not isinstance(prompt, str) else self.engine.tokenizer.encode(prompt)
            handles.append(self.engine.submit(request_id, prompt_ids, p))
            results.append(CompletionResult(request_id, prompt_ids))
        for handle, result in zip(handles, results):
            for out in handle:
                result.token_ids.extend(out.new_token_ids)
                result.text += out.new_text
                if out.finished:
                    result.finish_reason, result.usage = out.finish_reason, out.usage
                    if out.error:
                        raise RuntimeError(f"request {result.request_id} failed in the engine: {out.error}")
        return results

    def close(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "Appliance":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
