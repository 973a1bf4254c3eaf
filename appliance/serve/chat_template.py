"""The checkpoint's chat template, rendered the way transformers' `apply_chat_template` renders it.

Chat templates come with checkpoints and are untrusted code, so they run in Jinja's immutable sandbox with
the environment transformers gives them: trim_blocks, lstrip_blocks, loop controls, a `tojson` filter that
does not escape HTML, `raise_exception`, `strftime_now`, the `{% generation %}` tag, and the tokenizer's
special tokens (bos_token, eos_token, ...) as variables. Where the template lives: `chat_template.jinja`
beside the tokenizer (what transformers writes today), else `chat_template` in tokenizer_config.json (a
string, or a list of named templates of which "default" is used).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from appliance.core import bounded_json
from appliance.core.config import ModelSpec

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
# The variables and functions the renderer gives templates; a caller's extra template variables must not reuse them.
RENDERER_NAMES = frozenset(("messages", "tools", "documents", "add_generation_prompt", "additional_special_tokens",
                            "raise_exception", "strftime_now", *SPECIAL_TOKEN_KEYS))


class ChatTemplateError(ValueError):
    """A chat template that cannot be loaded or rendered; the message names the file or the reason."""


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering keeps the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict with "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class ChatTemplate:
    source: str                      # the file it came from, for messages
    template: jinja2.Template
    special_tokens: dict[str, Any]   # bos_token, eos_token, ... as the template sees them

    @classmethod
    def compile(cls, text: str, source: str, special_tokens: dict[str, Any] | None = None) -> "ChatTemplate":
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            template = env.from_string(text)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"the chat template in {source} does not compile: {exc} (line {exc.lineno})") from None
        return cls(source, template, dict(special_tokens or {}))

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        try:
            return self.template.render(messages=messages, tools=tools, documents=None,
                                        add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens, **kwargs)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the chat template ({self.source}) refused the messages: {exc}") from None
        except RecursionError:      # e.g. `tojson` of a deeply nested tool definition
            raise ChatTemplateError(f"the chat template ({self.source}) could not render the request: "
                                    f"values nested too deeply") from None
        except Exception as exc:  # noqa: BLE001 - template code on request data: e.g. `content + 1`, `x / 0`
            raise ChatTemplateError(f"the chat template ({self.source}) failed on the request's values: "
                                    f"{type(exc).__name__}: {exc}") from None


def tokenizer_dir(model: ModelSpec) -> Path | None:
    """Where the tokenizer files of a model live (None for random weights with the built tokenizer)."""
    if model.tokenizer:
        return Path(model.tokenizer).parent
    if model.weights != "random":
        return Path(model.weights)
    return None


def load_chat_template(model: ModelSpec) -> ChatTemplate | None:
    """The model's chat template, or None when its checkpoint has none."""
    root = tokenizer_dir(model)
    if root is None:
        return None
    config_path = root / "tokenizer_config.json"
    try:
        config = bounded_json.loads(config_path.read_text()) if config_path.is_file() else {}
    except json.JSONDecodeError as exc:
        raise ChatTemplateError(f"{config_path} is not valid JSON: {exc}") from None
    special: dict[str, Any] = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k))) is not None}
    extra = [t for v in config.get("additional_special_tokens") or () if (t := _token_text(v)) is not None]
    if extra:
        special["additional_special_tokens"] = extra
    jinja_path = root / "chat_template.jinja"
    if jinja_path.is_file():
        return ChatTemplate.compile(jinja_path.read_text(), str(jinja_path), special)
    text = config.get("chat_template")
    if isinstance(text, list):       # named templates: [{"name": "default", "template": "..."}, ...]
        text = next((t.get("template") for t in text if t.get("name") == "default"), None)
    if not isinstance(text, str) or not text:
        return None
    return ChatTemplate.compile(text, f"{config_path} (chat_template)", special)
