"""Grammar libraries for structured output, measured side by side: xgrammar, llguidance, outlines-core.

    python bench/bench_grammar.py                         # every library installed, vocab 512 and 129280
    python bench/bench_grammar.py --vocabs 512 --steps 64 --engine-rounds 3
    python bench/bench_grammar.py --skip-engine           # libraries only

Per library: its install footprint (the library and every distribution it requires, recursively, as installed
here; whether it requires torch, and which torch is installed), then for each vocabulary: compile time of a JSON
schema (a pydantic model with a nested object, a list and an enum) and of json_object (any JSON object), each to
its first token mask, and the per-token time to fill one row's bitmask along a walk of --steps tokens the grammar
allows (median). Vocabularies: 512, the byte-level BPE the tiny test models build (Qwen3 tiny and DeepSeek V4 tiny
both use appliance.core.tokenizer.Tokenizer.build(512)), and 129280 (DeepSeek V4's size), a synthetic byte-level
BPE vocabulary of distinct words and fragments of the Python standard library's sources (no download). Each
(library, vocabulary) runs in its own process with --timeout-s. Libraries not installed are reported as such
(the appliance needs only llguidance; `pip install xgrammar outlines-core` in a scratch venv to compare).

Then the engine (qwen3_tiny, CPU): 8 greedy requests decoding together, 0, 1, 4 and 8 of them constrained
(llguidance, a regex that cannot complete within the run): the median time of one engine step (EngineCore._step:
runner, mask, sampling, stop rules, output; the matcher's compile at submit is not in it), rounds interleaved, and the
bitmask fill + apply time of one row alone at both vocabulary sizes.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import re
import statistics
import subprocess
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import LoadWatch, spread  # noqa: E402

LIBRARIES = ("llguidance", "xgrammar", "outlines-core")


class Kind(str, Enum):
    CAT = "cat"
    DOG = "dog"
    BIRD = "bird"


class Address(BaseModel):
    street: str
    city: str
    zip_code: int


class Person(BaseModel):
    """The benchmark's schema: a nested object, a list and an enum."""

    name: str
    age: int = Field(ge=0, le=150)
    kind: Kind
    address: Address
    tags: list[str]


def schema_json() -> str:
    return json.dumps(Person.model_json_schema())


# -- tokenizers ---------------------------------------------------------------------------------------------

def byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def synthetic_vocab_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizers.Tokenizer with vocab_size ids: 3 specials, the 256 bytes, then distinct words
    and fragments of the standard library's sources (with and without a leading space), shortest first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    to_char = {b: c for c, b in byte_level_decoder().items()}
    specials = ["<|bos|>", "<|eos|>", "<|pad|>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for b in range(256):
        vocab[to_char[b]] = len(vocab)
    pieces: set[str] = set()
    stdlib = Path(os.__file__).parent
    for path in sorted(stdlib.rglob("*.py")):
        text = path.read_text(errors="ignore")
        for word in re.findall(r"\s?[A-Za-z_]+|\s?[0-9]+|\s?[^\sA-Za-z0-9_]+", text):
            pieces.add(word[:16])
            for k in (2, 3, 4, 6):
                pieces.add(word[:k])
        if len(pieces) > vocab_size * 3:
            break
    for piece in sorted(pieces, key=lambda p: (len(p), p)):
        token = "".join(to_char[b] for b in piece.encode("utf-8"))
        if token not in vocab:
            vocab[token] = len(vocab)
        if len(vocab) == vocab_size:
            break
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.add_special_tokens(specials)
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return tk


def hf_tokenizer(vocab_size: int):
    """(tokenizers.Tokenizer, eos id): the tiny models' own at 512, the synthetic one otherwise."""
    if vocab_size == 512:
        from appliance.core.tokenizer import Tokenizer

        built = Tokenizer.build(512)
        return built.tk, built.eos_token_id
    tk = synthetic_vocab_tokenizer(vocab_size)
    return tk, tk.token_to_id("<|eos|>")


def token_bytes(tk, vocab_size: int, eos: int) -> dict[bytes, list[int]]:
    """Each non-special token's bytes (outlines-core's Vocabulary takes them so)."""
    decode = byte_level_decoder()
    specials = {t.content for t in tk.get_added_tokens_decoder().values()}
    out: dict[bytes, list[int]] = {}
    for token, i in tk.get_vocab(with_added_tokens=True).items():
        if i == eos or token in specials or i >= vocab_size:
            continue
        raw = bytes(decode[c] for c in token) if all(c in decode for c in token) else token.encode()
        out.setdefault(raw, []).append(i)
    return out


# -- one library, one vocabulary ------------------------------------------------------------------------------

def walk(fill, allowed_of, advance, steps: int, seed: int = 0) -> list[float]:
    """Time fill() at each of `steps` tokens, advancing by a seeded choice among the allowed ones (EOS last)."""
    import random

    rng = random.Random(seed)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fill()
        times.append(time.perf_counter() - t0)
        allowed = allowed_of()
        if not allowed:
            break
        if not advance(rng.choice(allowed)):
            break
    return times


def allowed_ids(bitmask_row, vocab_size: int, eos: int) -> list[int]:
    import numpy

    bits = numpy.unpackbits(numpy.ascontiguousarray(bitmask_row).view(numpy.uint8), bitorder="little")[:vocab_size]
    ids = numpy.flatnonzero(bits).tolist()
    return [i for i in ids if i != eos]


def run_llguidance(tk, eos: int, vocab_size: int, schema: str, steps: int) -> dict[str, float]:
    import llguidance
    import llguidance.numpy as lnp

    t0 = time.perf_counter()
    ll = llguidance.LLTokenizer(tk.to_str(), n_vocab=vocab_size, eos_token=eos)
    tokenizer_s = time.perf_counter() - t0
    out = {"tokenizer_s": tokenizer_s}
    options = {"whitespace_flexible": False}
    for name, grammar in (("schema", llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)),
                          ("json_object", llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                                                        defaults=options))):
        bitmask = lnp.allocate_token_bitmask(1, vocab_size)
        t0 = time.perf_counter()
        matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
        lnp.fill_next_token_bitmask(matcher, bitmask, 0)
        out[f"{name}_compile_s"] = time.perf_counter() - t0
        assert not matcher.is_error(), matcher.get_error()
        if name == "schema":
            times = walk(lambda: lnp.fill_next_token_bitmask(matcher, bitmask, 0),
                         lambda: allowed_ids(bitmask[0], vocab_size, eos), matcher.consume_token, steps)
            out["mask_us"] = statistics.median(times) * 1e6
            out["mask_steps"] = len(times)
    return out


def run_xgrammar(tk, eos: int, vocab_size: int, schema: str, steps: int) -> dict[str, float]:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    t0 = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|eos|>")
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    out = {"tokenizer_s": time.perf_counter() - t0}
    for name, compile_ in (("schema", lambda: compiler.compile_json_schema(schema, any_whitespace=False)),
                           ("json_object", compiler.compile_builtin_json_grammar)):
        bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        t0 = time.perf_counter()
        matcher = xgr.GrammarMatcher(compile_())
        matcher.fill_next_token_bitmask(bitmask, 0)
        out[f"{name}_compile_s"] = time.perf_counter() - t0
        if name == "schema":
            times = walk(lambda: matcher.fill_next_token_bitmask(bitmask, 0),
                         lambda: allowed_ids(bitmask[0].numpy(), vocab_size, eos), matcher.accept_token, steps)
            out["mask_us"] = statistics.median(times) * 1e6
            out["mask_steps"] = len(times)
    return out


def run_outlines(tk, eos: int, vocab_size: int, schema: str, steps: int) -> dict[str, float]:
    import numpy
    import outlines_core as oc
    from outlines_core.json_schema import build_regex_from_schema

    t0 = time.perf_counter()
    vocab = oc.Vocabulary(eos, token_bytes(tk, vocab_size, eos))
    out = {"tokenizer_s": time.perf_counter() - t0}
    for name, source in (("schema", schema), ("json_object", json.dumps({"type": "object"}))):
        bitmask = numpy.full((1, (vocab_size + 31) // 32), -1, dtype=numpy.int32)
        t0 = time.perf_counter()
        guide = oc.Guide(oc.Index(build_regex_from_schema(source, whitespace_pattern=""), vocab))
        guide.write_mask_into(bitmask.ctypes.data, bitmask.size, bitmask.itemsize)
        out[f"{name}_compile_s"] = time.perf_counter() - t0
        if name == "schema":
            def advance(token: int) -> bool:
                guide.advance(token)
                return not guide.is_finished()
            times = walk(lambda: guide.write_mask_into(bitmask.ctypes.data, bitmask.size, bitmask.itemsize),
                         lambda: allowed_ids(bitmask[0], vocab_size, eos), advance, steps)
            out["mask_us"] = statistics.median(times) * 1e6
            out["mask_steps"] = len(times)
    return out


RUNNERS = {"llguidance": run_llguidance, "xgrammar": run_xgrammar, "outlines-core": run_outlines}


def one(library: str, vocab_size: int, steps: int) -> dict[str, Any]:
    tk, eos = hf_tokenizer(vocab_size)
    return RUNNERS[library](tk, eos, vocab_size, schema_json(), steps)


# -- footprint ----------------------------------------------------------------------------------------------

def requirement_names(dist: md.Distribution) -> list[str]:
    names = []
    for req in dist.requires or []:
        if "extra ==" in req:
            continue
        marker_ok = True
        if ";" in req:
            from packaging.markers import Marker
            marker_ok = Marker(req.split(";", 1)[1]).evaluate()
        if marker_ok:
            names.append(re.split(r"[ <>=!~;\[(]", req, maxsplit=1)[0])
    return names


def footprint(library: str) -> dict[str, Any]:
    """The library's installed size and its transitive requirements' (each once), as installed here."""
    try:
        root = md.distribution(library)
    except md.PackageNotFoundError:
        return {"installed": False}
    seen: dict[str, int] = {}
    todo = [library]
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            seen[key] = 0
            continue
        seen[key] = sum((f.size or 0) for f in dist.files or [])
        todo += requirement_names(dist)
    try:
        torch_version = md.version("torch")
    except md.PackageNotFoundError:
        torch_version = "not installed"
    return {"installed": True, "version": root.version, "requires": requirement_names(root),
            "closure": {k: v for k, v in seen.items()}, "total_mb": sum(seen.values()) / 2**20,
            "requires_torch": "torch" in seen, "torch_installed": torch_version}


# -- the engine ---------------------------------------------------------------------------------------------

def engine_steps(rounds: int, max_tokens: int) -> dict[str, Any]:
    import torch

    from appliance.core.constraint import OutputConstraint
    from appliance.core.request import SamplingParams
    from appliance.core.tokenizer import Tokenizer
    from appliance.engine.grammar import GrammarCompiler
    from appliance.offline import Appliance
    from npu.sampler import apply_token_bitmask

    rows = 8
    plain = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    never_done = SamplingParams(max_tokens=max_tokens, constraint=OutputConstraint.regex(r"[a-z ]{5000}"))
    prompts = [[5 + i, 40 + i, 90 + i, 7] for i in range(rows)]
    mixes = {f"{k} of {rows}": [never_done] * k + [plain] * (rows - k) for k in (0, 1, 4, 8)}
    per_step: dict[str, list[float]] = {label: [] for label in mixes}
    per_mask: dict[str, list[float]] = {label: [] for label in mixes}
    with Appliance.from_config(["+model=qwen3_tiny", "device=cpu", "max_model_len=512", "max_num_seqs=8"]) as app:
        # The engine core's step methods, timed on this one core (instance attributes). The Engine keeps its core
        # private (`_core`, appliance/engine/engine.py): this bench needs that handle.
        core = app.engine._core
        if core is None:
            raise RuntimeError("the engine has no started core at engine._core: bench_grammar times its step")
        step_times: list[float] = []
        step = core._step      # timed here: one engine step (execute -> sample (masks) -> update -> output)

        def timed(*step_args):
            t0 = time.perf_counter()
            finished = step(*step_args)
            step_times.append(time.perf_counter() - t0)
            return finished

        mask = core._mask_constrained
        mask_times: list[float] = []

        def timed_mask(*mask_args):
            t0 = time.perf_counter()
            refused = mask(*mask_args)
            mask_times.append(time.perf_counter() - t0)
            return refused

        core._step, core._mask_constrained = timed, timed_mask
        app.generate(prompts, plain)                                     # warm up
        for _ in range(rounds):
            for label, params in mixes.items():
                step_times.clear()
                mask_times.clear()
                app.generate(prompts, params)
                per_step[label].append(statistics.median(step_times))
                per_mask[label].append(statistics.median(mask_times))
    out: dict[str, Any] = {k: statistics.median(v) * 1e3 for k, v in per_step.items()}
    out["rounds"] = {k: [x * 1e3 for x in v] for k, v in per_step.items()}
    out["mask_rounds"] = {k: [x * 1e6 for x in v] for k, v in per_mask.items()}
    for vocab_size in (512, 129280):
        tk, eos = hf_tokenizer(vocab_size)
        compiler = GrammarCompiler(Tokenizer(tk, eos_token_id=eos), vocab_size)
        matcher = compiler.matcher(OutputConstraint.json_schema(schema_json()))
        logits = torch.randn(rows, vocab_size)
        times = []
        for _ in range(50):
            t0 = time.perf_counter()
            apply_token_bitmask(logits, [0], torch.from_numpy(compiler.fill_bitmask([matcher])))
            times.append(time.perf_counter() - t0)
        out[f"mask_row_us_{vocab_size}"] = statistics.median(times) * 1e6
        matcher.close()
    return out


# -- report -------------------------------------------------------------------------------------------------

def print_library_tables(libraries: list[str], vocabs: list[int], steps: int, timeout_s: float) -> None:
    """The footprint table, then one row per (vocabulary, library), each measured in its own process."""
    print("\n| library | version | requires | installed size (with deps) | requires torch |")
    print("|---|---|---|---:|---|")
    installed = []
    for lib in libraries:
        f = footprint(lib)
        if not f["installed"]:
            print(f"| {lib} | not installed | | | |")
            continue
        installed.append(lib)
        big = sorted(f["closure"].items(), key=lambda kv: -kv[1])[:4]
        torch_note = f"yes (installed: {f['torch_installed']})" if f["requires_torch"] else "no"
        print(f"| {lib} | {f['version']} | {', '.join(f['requires']) or '(none)'} | {f['total_mb']:.0f} MB "
              f"({', '.join(f'{k} {v / 2**20:.0f} MB' for k, v in big)}) | {torch_note} |")

    print("\n| library | vocab | tokenizer setup | JSON schema compile | json_object compile | mask per token "
          "(one row, median) |")
    print("|---|---:|---:|---:|---:|---:|")
    for vocab_size in vocabs:
        for lib in installed:
            cells = f"| {lib} | {vocab_size:,} |"
            try:
                proc = subprocess.run([sys.executable, __file__, "--one", lib, str(vocab_size), "--steps", str(steps)],
                                      capture_output=True, text=True, timeout=timeout_s)
                if proc.returncode != 0:
                    raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed")
                r = json.loads(proc.stdout.strip().splitlines()[-1])
                print(f"{cells} {r['tokenizer_s'] * 1e3:.1f} ms | {r['schema_compile_s'] * 1e3:.1f} ms | "
                      f"{r['json_object_compile_s'] * 1e3:.1f} ms | {r['mask_us']:.1f} us ({r['mask_steps']} tokens) |",
                      flush=True)
            except subprocess.TimeoutExpired:
                print(f"{cells} over {timeout_s:.0f} s | | | |", flush=True)
            except Exception as exc:  # noqa: BLE001 - one library's failure is a row, not the end of the run
                print(f"{cells} error: {exc} | | | |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocabs", type=int, nargs="+", default=[512, 129280])
    ap.add_argument("--libraries", nargs="+", default=list(LIBRARIES), choices=LIBRARIES)
    ap.add_argument("--steps", type=int, default=64, help="tokens of the mask walk")
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--engine-rounds", type=int, default=3)
    ap.add_argument("--engine-tokens", type=int, default=48)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--engine-only", action="store_true", help="only the engine step (no library comparison)")
    ap.add_argument("--one", nargs=2, metavar=("LIBRARY", "VOCAB"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), args.steps)))
        return

    watch = LoadWatch()
    print(watch.header(args.engine_rounds))
    print(f"- command: python bench/bench_grammar.py {' '.join(sys.argv[1:])}".rstrip())
    if args.engine_only:
        args.libraries, args.vocabs = [], []
    if args.libraries:
        print_library_tables(args.libraries, args.vocabs, args.steps, args.timeout_s)

    if not args.skip_engine:
        e = engine_steps(args.engine_rounds, args.engine_tokens)
        print(f"\nengine (qwen3_tiny, CPU, 8 greedy requests x {args.engine_tokens} tokens, llguidance): a round's "
              f"median step, median [min-max] of {args.engine_rounds} interleaved rounds:")
        print("| rows constrained | engine step, ms | of it: waiting for the masks + apply, us |")
        print("|---|---:|---:|")
        for label in e["rounds"]:
            print(f"| {label} | {spread(e['rounds'][label], '{:.2f}')} | {spread(e['mask_rounds'][label], '{:.0f}')} |")
        print(f"one row's bitmask fill + apply (JSON schema, first token): {e['mask_row_us_512']:.0f} us at vocab 512, "
              f"{e['mask_row_us_129280']:.0f} us at vocab 129,280")
    print(watch.footer())


if __name__ == "__main__":
    main()
