"""Tokenizer: a tokenizer.json from a checkpoint, or a small deterministic one built here for random weights.

`weights: random` models have no tokenizer file, so `Tokenizer.build(vocab_size)` trains a byte-level
BPE on a fixed embedded English text, offline, with exactly the model's vocab_size ids (special tokens
first, reserved padding tokens last if the text yields fewer merges). Same vocab_size, same tokenizer,
on every machine. No torch here.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from tokenizers import Tokenizer as HfTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from appliance.core import bounded_json
from appliance.core.errors import TokenizerError

if TYPE_CHECKING:
    from appliance.core.config import ModelSpec

log = logging.getLogger("appliance.core.tokenizer")

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, PAD)
# The markers of the chat formats the tiny models serve, one token each as in the released tokenizers (and kept
# in decoded text, as those mark them: not special): DeepSeek V4's (its encoder's BOS/EOS, roles, thinking and the
# DSML tool-call marker) and Qwen3's (ChatML turns, thinking, <tool_call>). The last ids of the vocabulary.
CHAT_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "｜DSML｜",
               "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
               "<|im_start|>", "<|im_end|>")
# Ids beyond which decode goes through decode_batch, which releases the GIL: a million ids take 0.2 s, during which
# a worker thread decoding them must not stall the server's event loop.
DECODE_IN_BATCH_IDS = 4096
# Names checkpoints commonly give their end-of-sequence token, tried when no config names it.
EOS_NAMES = (EOS, "<|endoftext|>", "<|im_end|>", "</s>", "<｜end▁of▁sentence｜>", "<eos>")

TRAINING_TEXT = """\
The appliance serves language models on accelerator servers. An engineer writes one small file that
describes the deployment: which model to load, how many sequences may run at once, how much of each
device's memory the cache may take, and where the server listens. The appliance reads that file, checks
every value before it touches a device, and explains any mistake by naming the key, the value and the
rule that was broken. Then it loads the weights, runs one step at the largest size the settings allow,
and measures how much memory remains. The remaining memory is divided into pages for the key and value
cache, and the number of pages for every group is reported back exactly as it was allocated.

A request arrives with a prompt and a few sampling settings. The scheduler places it in the waiting
queue, and when there is room it gives the request pages and starts the prefill. Long prompts are cut
into chunks so that short requests are not kept waiting behind them. Each step of the engine mixes the
chunks of new prompts with single tokens of sequences that are already decoding. When a sequence
finishes, because it produced the end token, reached its limit, or met a stop string, its pages are
returned to the pool at once, and another request can use them in the very next step.

Memory is the scarce resource. A page holds the rows of many layers for a fixed number of tokens. Some
layers only look at a short window of recent tokens, so their pages are reused in a ring; other layers
compress older tokens into fewer rows and keep their whole history. The planner is a pure function: it
takes the total memory of each device, the fraction that may be used, and the peak memory of everything
that is not cache, and it returns the number of slots and the number of blocks of every group. The same
function runs offline, so a whole fleet can be planned and compared without any hardware at all.

Good tests compare the model with an independent reference. The small model used in tests has random
weights, yet it must produce the same greedy tokens as the reference implementation on the same weights,
whether the sequences run alone or together, whether their prompts were cached or computed again, and
whether they were paused and resumed. Numbers in reports are computed, never copied, and every number
that is printed can be traced back to the inputs that produced it. When something fails, the message says
what was expected, what was found, and what to change.

Weather notes from a small town: the morning was cold and bright, with frost on the fields and a thin
mist over the river. By noon the sun had warmed the stones of the bridge, children were playing near the
water, and the baker sold the last of the bread before two o'clock. In the evening clouds came from the
west, the wind turned, and a light rain fell on the roofs while people walked home from the market with
baskets of apples, onions, cheese and fresh fish. Numbers of the day: 3 degrees at six, 14 degrees at
one, 9 degrees at eight; 12 boats on the river, 150 loaves sold, 42 visitors at the old library.
"""


def _train(vocab_size: int, text: str) -> HfTokenizer:
    base = 256 + len(SPECIAL_TOKENS) + len(CHAT_TOKENS)
    if vocab_size < base:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer: it needs at least "
                         f"{base} ids (256 bytes + {len(SPECIAL_TOKENS)} special tokens + {len(CHAT_TOKENS)} chat "
                         f"format markers)")
    tk = HfTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(CHAT_TOKENS), min_frequency=1, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    tk.add_tokens(list(CHAT_TOKENS))
    short = vocab_size - tk.get_vocab_size(with_added_tokens=True)
    if short > 0:  # the text ran out of merges: fill the remaining ids so ids match the embedding rows
        tk.add_special_tokens([f"<|reserved_{i}|>" for i in range(short)])
    return tk


class Tokenizer:
    """encode / decode / eos_token_id over a `tokenizers` Tokenizer, plus incremental detokenizers."""

    def __init__(self, tk: HfTokenizer, eos_token_id: int | None, bos_token_id: int | None = None,
                 pad_token_id: int | None = None, source: str = ""):
        self.tk = tk
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self.pad_token_id = pad_token_id
        self.source = source

    @classmethod
    def build(cls, vocab_size: int, text: str = TRAINING_TEXT) -> "Tokenizer":
        """The deterministic tokenizer of `weights: random` models: byte-level BPE with exactly vocab_size ids."""
        tk = _train(vocab_size, text)
        ids = [tk.token_to_id(t) for t in SPECIAL_TOKENS]
        return cls(tk, eos_token_id=ids[1], bos_token_id=ids[0], pad_token_id=ids[2],
                   source=f"built (byte-level BPE, vocab {vocab_size})")

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        """A tokenizer.json; the eos id comes from the neighbouring configs, else a known token name."""
        path = Path(path)
        if not path.is_file():
            raise TokenizerError(f"tokenizer file {str(path)!r} does not exist. Fix: copy the checkpoint's "
                                 f"tokenizer.json into the checkpoint directory, or point model.tokenizer at one")
        try:
            tk = HfTokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for an unparsable file
            raise TokenizerError(f"tokenizer file {str(path)!r} cannot be loaded ({exc}). Fix: restore the "
                                 f"checkpoint's tokenizer.json (a Hugging Face tokenizers file), or point "
                                 f"model.tokenizer at one") from None
        eos = _eos_from_configs(path.parent, tk)
        if eos is None:
            eos = next((tk.token_to_id(n) for n in EOS_NAMES if tk.token_to_id(n) is not None), None)
        if eos is None:
            log.warning("no end-of-sequence token found for %s; generation stops only on length or stop strings", path)
        return cls(tk, eos_token_id=eos, bos_token_id=tk.token_to_id(BOS), pad_token_id=tk.token_to_id(PAD),
                   source=str(path))

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """UTF-8 bytes of the longest vocabulary entry: no token covers more bytes of input text (byte-level
        entries spell one byte per character, sentencepiece and byte-fallback entries at least as many), so
        a text of N bytes has at least N / max_token_bytes tokens."""
        return max(len(token.encode("utf-8")) for token in self.tk.get_vocab(with_added_tokens=True))

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not), so a long prompt tokenized in a
        # worker thread does not stall the server's event loop, health checks included.
        ids = self.tk.encode_batch([text], add_special_tokens=False)[0].ids
        return [self.bos_token_id, *ids] if add_bos and self.bos_token_id is not None else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        if len(ids) > DECODE_IN_BATCH_IDS:  # decode_batch releases the GIL while it works (decode does not)
            return self.tk.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self.tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tk.token_to_id(token)

    def to_json(self) -> str:
        return self.tk.to_str()

    def save(self, path: str | Path) -> None:
        self.tk.save(str(path))

    def detokenizer(self, prompt_ids: Iterable[int] = (), skip_special_tokens: bool = True,
                    use_decode_stream: bool = True) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens, use_decode_stream)


def _read_config(path: Path) -> dict:
    """A checkpoint's JSON config file (a missing one reads as empty), within bounded_json's bounds;
    TokenizerError naming the file when it cannot be read."""
    if not path.is_file():
        return {}
    try:
        value = bounded_json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"checkpoint file {str(path)!r} is not readable JSON ({exc}). Fix: restore the "
                             f"checkpoint's {path.name}") from None
    return value if isinstance(value, dict) else {}


def _eos_from_configs(root: Path, tk: HfTokenizer) -> int | None:
    for name in ("generation_config.json", "config.json"):
        value = _read_config(root / name).get("eos_token_id")
        if isinstance(value, list) and value:
            value = value[0]
        if isinstance(value, int):
            return value
    token = _read_config(root / "tokenizer_config.json").get("eos_token")
    if isinstance(token, dict):
        token = token.get("content")
    if isinstance(token, str):
        return tk.token_to_id(token)
    return None


def check_special_ids(root: Path, vocab_size: int) -> None:
    """The eos and bos token ids that generation_config.json and config.json give lie in the vocabulary
    [0, vocab_size): an id outside it is never sampled, so generation would never end on it."""
    for name in ("generation_config.json", "config.json"):
        config = _read_config(root / name)
        for key in ("eos_token_id", "bos_token_id"):
            value = config.get(key)
            ids = value if isinstance(value, list) else [value]
            bad = [i for i in ids if i is not None and not (isinstance(i, int) and not isinstance(i, bool)
                                                            and 0 <= i < vocab_size)]
            if bad:
                raise TokenizerError(f"checkpoint file {str(root / name)!r}: {key}={value!r} is not a token id in the "
                                     f"vocabulary [0, {vocab_size}) (model.layout.vocab_size). Fix: restore the "
                                     f"checkpoint's {name}")


class IncrementalDetokenizer:
    """Turns generated ids into text deltas; never emits half of a multi-byte UTF-8 character.

    Uses tokenizers' DecodeStream when available; otherwise decodes a short window of recent ids and
    emits what grew, holding back text that ends in U+FFFD (an incomplete character) until it completes.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Iterable[int] = (), skip_special_tokens: bool = True,
                 use_decode_stream: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        prompt = list(prompt_ids)
        self._stream = None
        if use_decode_stream and hasattr(decoders, "DecodeStream"):
            try:
                self._stream = decoders.DecodeStream(ids=prompt[-8:], skip_special_tokens=skip_special_tokens)
            except TypeError:  # older tokenizers: no prompt context
                self._stream = decoders.DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids = prompt[-8:]
        self._prefix = max(0, len(self._ids) - 5)
        self._read = len(self._ids)

    @property
    def uses_decode_stream(self) -> bool:
        return self._stream is not None

    def push(self, token_id: int) -> str:
        """The text this token completes ('' while a character is still incomplete)."""
        if self._stream is not None:
            return self._stream.step(self.tokenizer.tk, token_id) or ""
        self._ids.append(token_id)
        before = self.tokenizer.decode(self._ids[self._prefix:self._read], self.skip)
        after = self.tokenizer.decode(self._ids[self._prefix:], self.skip)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            delta = after[len(before):]
            self._prefix, self._read = self._read, len(self._ids)
            return delta
        return ""


def load_tokenizer_for(model: "ModelSpec") -> Tokenizer:
    """model.tokenizer, else <weights>/tokenizer.json, else (weights: random) the built tokenizer."""
    if model.tokenizer:
        tok = Tokenizer.from_file(model.tokenizer)
    elif model.weights != "random":
        tok = Tokenizer.from_file(Path(model.weights) / "tokenizer.json")
    else:
        return Tokenizer.build(model.layout.vocab_size)
    check_special_ids(Path(model.tokenizer).parent if model.tokenizer else Path(model.weights),
                      model.layout.vocab_size)
    if tok.vocab_size > model.layout.vocab_size:
        raise TokenizerError(f"tokenizer {tok.source} has {tok.vocab_size} ids but model.layout.vocab_size is "
                             f"{model.layout.vocab_size}: ids beyond the embedding would fail. Fix: use the "
                             f"tokenizer.json made for this checkpoint (model.tokenizer)")
    return tok
