"""Chat templates render exactly as transformers' apply_chat_template renders them (the oracle), from
tokenizer_config.json or chat_template.jinja; templates cannot escape the sandbox; no template is None."""

from __future__ import annotations

import dataclasses
import json

import pytest

from appliance.config.compose import load_runtime_config
from appliance.core.tokenizer import Tokenizer
from appliance.serve.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from tests.serve.test_http_e2e import CHAT_TEMPLATE

transformers = pytest.importorskip("transformers")

# Loop controls, namespace, tojson, the generation tag, tools and a custom keyword.
RICH_TEMPLATE = (
    "{%- set ns = namespace(n=0) %}"
    "{%- if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'stop' %}{% break %}{% endif %}"
    "{%- set ns.n = ns.n + 1 %}"
    "[{{ ns.n }}|{{ m['role'] }}]{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
    "{{ eos_token }}{% endgeneration %}{% else %}{{ m['content'] | trim }}{% endif %}\n"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}[assistant]{% if enable_thinking is defined and not enable_thinking %}"
    "<no-think>{% endif %}{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "  Héllo, \"world\" <b>  "},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "And the weather?"}]
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string", "description": "ünïcode & <tags>"}}}}}]


def tokenizer_dir(tmp_path, template: str, as_jinja_file: bool = False):
    Tokenizer.build(512).save(tmp_path / "tokenizer.json")
    config = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>",
              "tokenizer_class": "PreTrainedTokenizerFast"}
    if as_jinja_file:
        (tmp_path / "chat_template.jinja").write_text(template)
    else:
        config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    rc = load_runtime_config(["+model=qwen3_tiny"])
    return dataclasses.replace(rc.model, tokenizer=str(tmp_path / "tokenizer.json"))


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, RICH_TEMPLATE], ids=["chatml", "rich"])
@pytest.mark.parametrize("as_jinja_file", [False, True], ids=["tokenizer_config", "jinja_file"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_like_transformers(tmp_path, template, as_jinja_file, add_generation_prompt):
    model = tokenizer_dir(tmp_path, template, as_jinja_file)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    for kwargs in ({}, {"tools": TOOLS}, {"enable_thinking": False}):
        ours = load_chat_template(model).render(MESSAGES, add_generation_prompt=add_generation_prompt, **kwargs)
        theirs = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt,
                                        **kwargs)
        assert ours == theirs


def test_template_errors_and_sandbox(tmp_path):
    model = tokenizer_dir(tmp_path, CHAT_TEMPLATE)
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        load_chat_template(model).render([{"role": "tool", "content": "x"}])
    escape = ChatTemplate.compile("{{ messages.__class__.__mro__ }}", "test")
    with pytest.raises(ChatTemplateError):
        escape.render(MESSAGES)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate.compile("{% for %}", "test")


def test_no_template_is_none(tmp_path):
    model = tokenizer_dir(tmp_path, "")
    assert load_chat_template(model) is None
    assert load_chat_template(load_runtime_config([]).model) is None      # random weights, built tokenizer


def test_tools_nested_past_the_recursion_limit_are_a_template_error_not_a_crash():
    """`tojson` of a value nested deeper than Python's recursion limit (JSON allows it, pydantic passes it)."""
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    template = ChatTemplate.compile(RICH_TEMPLATE, "test")
    with pytest.raises(ChatTemplateError, match="nested too deeply"):
        template.render(MESSAGES, tools=[{"type": "function", "function": {"parameters": deep}}])


@pytest.mark.parametrize("template, kwargs", [
    ("{{ messages[0]['content'] + 1 }}", {}),                                  # TypeError on a string
    ("{{ 1 / (messages | length - 4) }}", {}),                                 # ZeroDivisionError
    ("{{ lang + 1 }}", {"lang": "en"}),                                           # a caller's template variable
])
def test_a_template_failing_on_the_request_values_is_a_template_error(template, kwargs):
    """Untrusted template code on request data: any failure is the request's 400, not the server's 500."""
    with pytest.raises(ChatTemplateError, match="failed on the request's values"):
        ChatTemplate.compile(template, "test").render(MESSAGES, **kwargs)
