"""A step that holds only non-final prompt chunks asking for prompt logprobs (nothing sampled) runs as is: it
used to fail (an empty float index) and pass only on the one-by-one retry, which logged an exception per chunk."""

from __future__ import annotations

import logging

import pytest

from appliance.core.request import FinishReason, SamplingParams
from appliance.offline import Appliance

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_prompt_chunks_with_prompt_logprobs_and_no_sampled_row_need_no_retry(caplog):
    with caplog.at_level(logging.ERROR, logger="appliance.engine.core"):
        with Appliance.from_config(["device=cpu", "device.cpu_threads=1"]) as app:
            (result,) = app.generate([list(range(3, 103))],     # 100 tokens: chunks of 32 (tokens_in_flight)
                                     SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1))
    assert not [r for r in caplog.records if "engine step failed" in r.getMessage()]
    assert result.finish_reason is FinishReason.LENGTH and len(result.prompt_logprobs) == 100
