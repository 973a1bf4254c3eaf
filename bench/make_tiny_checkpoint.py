"""A checkpoint directory of a tiny model YAML, written locally: something to serve with `+model=hf
model.weights=DIR` (or to point any tool at) before a real checkpoint is at hand.

    python bench/make_tiny_checkpoint.py qwen3_tiny ckpt/qwen3-tiny      # Qwen3ForCausalLM, 2 layers
    python bench/make_tiny_checkpoint.py dsv4_tiny ckpt/dsv4-tiny        # DeepseekV4ForCausalLM, 5 layers + MTP

It holds config.json (the architecture's Hugging Face config, so transformers loads the directory too),
model.safetensors (the model's seeded random weights, under the released tensor names) and tokenizer.json (the
small byte-level tokenizer the embedded default builds). Nothing is downloaded; the text it generates is
meaningless. bench/make_tiny_qwen3.py writes the larger transformers-initialised Qwen3 the peer benchmarks use.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.config.compose import load_runtime_config  # noqa: E402
from appliance.config.overrides import available_models  # noqa: E402
from tests.support.checkpoints import write_tiny_checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", choices=[m for m in available_models() if m.endswith("_tiny")],
                    help="the model YAML in conf/model/")
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    ap.add_argument("--std", type=float, default=0.02, help="standard deviation of the weights (default 0.02)")
    args = ap.parse_args()
    model = load_runtime_config([f"+model={args.model}"]).model
    out = write_tiny_checkpoint(args.out_dir, model, seed=args.seed, std=args.std)
    print(f"wrote {out}: " + ", ".join(sorted(p.name for p in out.iterdir())))


if __name__ == "__main__":
    main()
