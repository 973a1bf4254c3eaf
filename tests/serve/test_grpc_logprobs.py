"""Logprobs over gRPC (GenerateResponse.logprobs / prompt_logprobs) from the real engine: the same values the
engine computes in-process (which tests/engine/test_engine_logprobs.py checks against transformers), and bad
values refused with INVALID_ARGUMENT naming the field."""

from __future__ import annotations

from appliance.config.compose import load_runtime_config
from appliance.core.request import RequestOutput, SamplingParams, TokenLogprob
from appliance.offline import Appliance
from appliance.serve.api import appliance_pb2 as pb
from appliance.serve.convert import generate_request, generate_response, to_output
from tests.serve.harness import assert_refused, serve_hooked_engine

OVERRIDES = ["+model=qwen3_tiny", "device=cpu", "max_model_len=128", "max_num_seqs=4", "server.port=0",
             "server.http_port=0", "server.grace_period_s=5"]
PROMPT = list(range(5, 45))


def test_logprobs_round_trip_through_the_proto():
    out = RequestOutput("r", (7, 9), "ab", logprobs=(TokenLogprob(7, -0.5, 1, ((7, -0.5), (3, -1.25))),
                                                     TokenLogprob(9, -2.0, 4, ())),
                        prompt_logprobs=(None, TokenLogprob(4, -3.5, 2, ((1, -0.25),))), prompt_token_ids=(2, 4))
    assert to_output(pb.GenerateResponse.FromString(generate_response(out).SerializeToString())) == out


def test_generate_streams_the_engines_logprobs():
    rc = load_runtime_config(OVERRIDES)
    params = dict(max_tokens=5, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    with Appliance.from_config(rc) as app:
        expected = app.generate([PROMPT], SamplingParams(**params))[0]
    srv = serve_hooked_engine(rc)
    try:
        with srv.client() as client:
            outs = list(client.generate(PROMPT, **params))
            stub = client.stub
            assert_refused(stub, generate_request(PROMPT, max_tokens=2, logprobs=21), "sampling.logprobs")
            assert_refused(stub, generate_request(PROMPT, max_tokens=2, prompt_logprobs=99), "sampling.prompt_logprobs")
    finally:
        srv.stop(60)
    got = [lp for out in outs for lp in out.logprobs or ()]
    assert [lp.token_id for lp in got] == expected.token_ids
    assert [o.prompt_token_ids for o in outs if o.prompt_token_ids] == [tuple(PROMPT)]
    prompt = next(o.prompt_logprobs for o in outs if o.prompt_logprobs)
    for a, b in zip([*got, *prompt[1:]], [*expected.logprobs, *expected.prompt_logprobs[1:]], strict=True):
        assert (a.token_id, a.rank, [t for t, _ in a.top]) == (b.token_id, b.rank, [t for t, _ in b.top])
        assert abs(a.logprob - b.logprob) < 1e-5
    assert prompt[0] is None and len(prompt) == len(PROMPT)
