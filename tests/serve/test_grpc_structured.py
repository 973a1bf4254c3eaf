"""Structured output over gRPC (SamplingParams.constraint): the proto carries every kind, the real engine's
output matches the constraint and finishes with STOP, and a bad one is INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import re

import pytest

from appliance.config.compose import load_runtime_config
from appliance.core.constraint import OutputConstraint
from appliance.core.request import FinishReason
from appliance.serve.api import appliance_pb2 as pb
from appliance.serve.convert import generate_request, sampling_message, sampling_params
from tests.serve.harness import assert_refused, serve_hooked_engine

OVERRIDES = ["+model=qwen3_tiny", "device=cpu", "max_model_len=128", "max_num_seqs=4", "server.port=0",
             "server.http_port=0", "server.grace_period_s=5"]
PROMPT = list(range(5, 25))


@pytest.mark.parametrize("constraint", [
    OutputConstraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}},
                                 field="sampling.constraint.json_schema"),
    OutputConstraint.json_object(field="sampling.constraint.json_object"),
    OutputConstraint.regex("[a-z]+", field="sampling.constraint.regex"),
    OutputConstraint.grammar('start: "x" /[0-9]/', field="sampling.constraint.grammar"),
    OutputConstraint.choice(["yes", "no"], field="sampling.constraint.choice"),
])
def test_every_kind_round_trips_through_the_proto(constraint):
    msg = pb.SamplingParams.FromString(sampling_message(constraint=constraint).SerializeToString())
    assert sampling_params(msg).constraint == constraint


def test_an_unset_constraint_is_none():
    assert sampling_params(sampling_message()).constraint is None


def test_generate_matches_the_constraint_and_refuses_a_bad_one():
    srv = serve_hooked_engine(load_runtime_config(OVERRIDES))
    regex = r"[a-z]{3}-[0-9]{2}"
    try:
        with srv.client() as client:
            outs = list(client.generate(PROMPT, max_tokens=40, constraint=OutputConstraint.regex(regex)))
            stub = client.stub
            assert_refused(stub, generate_request(PROMPT, max_tokens=4, constraint=OutputConstraint.regex("a(")),
                           "sampling.constraint.regex")
            bad = generate_request(PROMPT, max_tokens=4)
            bad.sampling.constraint.json_object = False
            assert_refused(stub, bad, "sampling.constraint.json_object")
    finally:
        srv.stop(60)
    assert re.fullmatch(regex, "".join(o.new_text for o in outs))
    assert outs[-1].finish_reason is FinishReason.STOP
