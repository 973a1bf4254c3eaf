"""Structured output through the real server with the official openai client: `parse` with a pydantic model,
response_format json_object, vLLM's structured_outputs (regex, choice, grammar), errors naming the field, and
unconstrained requests beside constrained ones keeping their greedy text. The random-weight Qwen3 tiny model
follows no instruction: only the grammar mask makes its output valid."""

from __future__ import annotations

import http.client
import json
import re
from concurrent.futures import ThreadPoolExecutor
from enum import Enum

import pytest
from pydantic import BaseModel, Field

openai = pytest.importorskip("openai")

from tests.serve.test_http_e2e import MESSAGES, TOKEN, checkpoint, client, served  # noqa: E402,F401

MODEL = "qwen3-tiny"


class Kind(str, Enum):
    CAT = "cat"
    DOG = "dog"


class Tag(BaseModel):
    n: int = Field(ge=0, le=99)


class Pet(BaseModel):
    name: str = Field(max_length=6)
    kind: Kind
    tags: list[Tag] = Field(max_length=2)


def parse(client, **kwargs):  # noqa: F811
    """client.chat.completions.parse where this openai version has it, else client.beta.chat.completions.parse."""
    completions = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    return completions(model=MODEL, messages=MESSAGES, **kwargs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_parse_with_a_pydantic_model_returns_valid_objects(client, temperature):  # noqa: F811
    r = parse(client, response_format=Pet, max_tokens=120, temperature=temperature, seed=3, n=2)
    assert len(r.choices) == 2
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Pet)
        assert Pet.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_yields_parseable_json(client):  # noqa: F811
    """Any JSON object: a random model's strings and nesting may run past max_tokens, so a few seeds are drawn;
    every one that the grammar finished ("stop") is a JSON object, and most finish."""
    finished = []
    for seed in range(4):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=900, temperature=1.0, seed=seed,
                                           response_format={"type": "json_object"})
        choice = r.choices[0]
        assert choice.finish_reason in ("stop", "length")
        if choice.finish_reason == "stop":
            finished.append(json.loads(choice.message.content))
    assert len(finished) >= 2 and all(isinstance(value, dict) for value in finished)


def test_structured_outputs_regex_and_choice_match(client):  # noqa: F811
    regex = r"[a-z]{2,5}-[0-9]{2}"
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30, temperature=0,
                                       extra_body={"structured_outputs": {"regex": regex}})
    assert re.fullmatch(regex, r.choices[0].message.content) and r.choices[0].finish_reason == "stop"
    choices = ["sunny", "light rain", "cold and bright"]
    c = client.completions.create(model=MODEL, prompt="The weather today:", max_tokens=30, temperature=1.0, seed=4,
                                  extra_body={"structured_outputs": {"choice": choices}})
    assert c.choices[0].text in choices and c.choices[0].finish_reason == "stop"
    g = client.completions.create(model=MODEL, prompt="Count:", max_tokens=30, temperature=0,
                                  extra_body={"structured_outputs": {"grammar": 'start: "n=" /[0-9]{1,3}/ ";"'}})
    assert re.fullmatch(r"n=[0-9]{1,3};", g.choices[0].text)


def test_streamed_structured_output_is_the_whole(client):  # noqa: F811
    regex = r"[a-z ]{12}\."
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
                                            stream=True, extra_body={"structured_outputs": {"regex": regex}})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert re.fullmatch(regex, text) and chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, param", [
    ({"structured_outputs": {"regex": "a("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"guided_json": {}}}, "structured_outputs.guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
])
def test_a_bad_constraint_is_a_400_naming_the_field(client, body, param):  # noqa: F811
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, extra_body=body)
    assert info.value.body["param"] == param, info.value.body


def test_a_lone_surrogate_in_a_constraint_is_a_400_not_a_crash(served):  # noqa: F811
    """JSON may escape a lone surrogate ("\\ud800"), which the grammar library cannot take: 400 naming the field."""
    _, port = served
    body = ('{"model": "qwen3-tiny", "prompt": "x", "max_tokens": 2, '
            '"structured_outputs": {"regex": "a\\ud800"}}')
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json",
                                                   "Authorization": f"Bearer {TOKEN}"})
    response = conn.getresponse()
    answer = json.loads(response.read())
    conn.close()
    assert response.status == 400 and answer["error"]["param"] == "structured_outputs.regex", answer


def test_unconstrained_requests_keep_their_greedy_text_beside_constrained_ones(client):  # noqa: F811
    def plain():
        return client.completions.create(model=MODEL, prompt="The cache holds pages", max_tokens=24, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    def constrained(i):
        return client.completions.create(model=MODEL, prompt=f"Item {i}:", max_tokens=60, temperature=0,
                                         extra_body={"structured_outputs": {"regex": r"[a-z ]{30}\."}})

    alone = plain()
    with ThreadPoolExecutor(3) as pool:
        others = [pool.submit(constrained, i) for i in range(2)]
        beside = pool.submit(plain)
        assert beside.result() == alone
        assert all(re.fullmatch(r"[a-z ]{30}\.", o.result().choices[0].text) for o in others)
