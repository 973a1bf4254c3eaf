"""The random Qwen3 shapes the peer benchmarks (bench_peers.py, bench_serve_peers.py) can run, and their checkpoints.

One shape says little about a CPU engine: a tiny model is bound by per-step overheads, a wider one by memory
bandwidth and matmul kernels. So both scripts take `--shapes` (names below, comma-separated) and print one table
section per shape. Every shape has vocab 32,000 (the prompts are random ids in 1..31,999; id 0 is the
end-of-sequence token) and untied embeddings. The checkpoint of a shape and dtype is made once under the peers
directory with bench/make_tiny_qwen3.py (with its word-level tokenizer, which the servers and clients need).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
VOCAB = 32000
EOS = 0
DTYPE_SUFFIX = {"bfloat16": "bf16", "float32": "fp32"}


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int

    def describe(self) -> str:
        return (f"{self.layers} layers, hidden {self.hidden:,}, {self.heads} heads / {self.kv_heads} KV heads x "
                f"{self.head_dim}, intermediate {self.inter:,}, vocab {VOCAB:,}")

    def checkpoint_name(self, dtype: str) -> str:
        """qwen3-<shape>-<bf16|fp32>; the default shape keeps its older qwen3-tiny-* name, so checkpoints made
        before --shapes existed are reused."""
        return f"qwen3-{'tiny' if self.name == DEFAULT_SHAPE else self.name}-{DTYPE_SUFFIX[dtype]}"

    def config_matches(self, config: dict) -> bool:
        return (config.get("num_hidden_layers"), config.get("hidden_size"), config.get("intermediate_size"),
                config.get("num_attention_heads"), config.get("num_key_value_heads"), config.get("head_dim"),
                config.get("vocab_size")) == (self.layers, self.hidden, self.inter, self.heads, self.kv_heads,
                                              self.head_dim, VOCAB)


SHAPES = {s.name: s for s in (
    Shape("4x512", layers=4, hidden=512, inter=1536, heads=8, kv_heads=2, head_dim=64),      # issue 16's
    Shape("6x768", layers=6, hidden=768, inter=2048, heads=12, kv_heads=2, head_dim=64),     # issue 37's
    Shape("12x1024", layers=12, hidden=1024, inter=3072, heads=16, kv_heads=4, head_dim=64),
    Shape("8x2048kv1", layers=8, hidden=2048, inter=5632, heads=16, kv_heads=1, head_dim=128),
)}
DEFAULT_SHAPE = "4x512"


def parse_shapes(text: str) -> list[Shape]:
    """--shapes "4x512,6x768" -> the shapes, in that order; exits naming the known ones on an unknown name."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown or not names:
        sys.exit(f"--shapes: unknown {unknown or 'empty list'}; choose from {', '.join(SHAPES)}")
    return [SHAPES[n] for n in names]


def add_shapes_argument(parser) -> None:
    parser.add_argument("--shapes", type=parse_shapes, default=[SHAPES[DEFAULT_SHAPE]],
                        help=f"comma-separated random Qwen3 shapes, one table section each (default {DEFAULT_SHAPE}): "
                             + "; ".join(f"{s.name} = {s.describe()}" for s in SHAPES.values()))


def checkpoint(peers_dir: str | Path, shape: Shape, dtype: str) -> str:
    """The shape's checkpoint directory in dtype, made (with a tokenizer) when absent; a directory of that name
    holding another shape is an error rather than a silently wrong table."""
    path = Path(peers_dir) / shape.checkpoint_name(dtype)
    config = path / "config.json"
    if not config.exists():
        print(f"making {path} (bench/make_tiny_qwen3.py, {shape.describe()})", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, str(BENCH / "make_tiny_qwen3.py"), str(path), "--dtype", dtype,
                        "--vocab", str(VOCAB), "--layers", str(shape.layers), "--hidden", str(shape.hidden),
                        "--inter", str(shape.inter), "--heads", str(shape.heads), "--kv-heads", str(shape.kv_heads),
                        "--head-dim", str(shape.head_dim), "--with-tokenizer"], check=True)
    if not shape.config_matches(json.loads(config.read_text())):
        sys.exit(f"{config} is not shape {shape.name} ({shape.describe()}); remove {path} to have it remade")
    return str(path)
