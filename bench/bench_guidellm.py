"""GuideLLM (vLLM's serving benchmark, OpenAI API client) against this appliance's HTTP front end.

    python -m venv /tmp/guidellm && /tmp/guidellm/bin/pip install guidellm      # once; kept out of our deps
    python bench/bench_guidellm.py --guidellm /tmp/guidellm/bin/guidellm          # tiny Qwen3 on this CPU
    python bench/bench_guidellm.py --guidellm ... --streams 16 --requests 256 -- device=cpu max_num_seqs=32

Writes a tiny Qwen3 checkpoint (guidellm needs its tokenizer to make synthetic prompts of exact lengths),
serves it with `python -m appliance +model=hf model.weights=DIR`, runs `guidellm run` with a concurrent
profile (synthetic prompts, fixed output lengths), prints guidellm's tables and keeps its JSON report.
Extra Hydra overrides for the server follow `--`. Nothing is downloaded (HF_HUB_OFFLINE=1).

--runs N (default 3): guidellm runs N times against the one server (started once), each run's JSON report
kept as <out stem>-run<i>.json; guidellm prints its own tables per run (it has no peer to interleave with
here), and this script prints the machine and the load average at start and end around them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_grpc import stop_server  # noqa: E402
from bench_http import start_server  # noqa: E402
from report import LoadWatch, add_runs_argument, progress  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--guidellm", default="guidellm", help="the guidellm executable")
    ap.add_argument("--streams", type=int, default=8, help="concurrent requests")
    ap.add_argument("--requests", type=int, default=64, help="requests in the run")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, default=Path("guidellm.json"), help="guidellm's JSON report")
    add_runs_argument(ap)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for the server (after --)")
    args = ap.parse_args()
    watch = LoadWatch()
    print(watch.header(args.runs), flush=True)

    from appliance.config.compose import load_runtime_config
    from tests.support.checkpoints import write_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_tiny_checkpoint(Path(tmp) / "qwen3-tiny", load_runtime_config(["+model=qwen3_tiny"]).model, 5)
        (ckpt / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>"}))
        proc, _, http_address = start_server(["+model=hf", f"model.weights={ckpt}", "device=cpu",
                                              "max_model_len=1024", *args.overrides], Path(tmp) / "run")
        statuses = []
        try:
            for i in range(args.runs):
                out = args.out.resolve().with_name(f"{args.out.stem}-run{i + 1}{args.out.suffix}")
                cmd = [args.guidellm, "run",
                       "--backend", f"kind=openai_http,target=http://{http_address},request_format=/v1/completions",
                       "--profile", f"kind=concurrent,streams={args.streams}",
                       "--constraint", f"kind=max_requests,count={args.requests}",
                       "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},"
                                 f"output_tokens={args.output_tokens}",
                       "--tokenizer", f"kind=huggingface_auto,model={ckpt}",
                       "--output", f"kind=json,path={out}", "--disable-console-interactive"]
                progress(f"[bench_guidellm] run {i + 1}/{args.runs} ...")
                print("$", " ".join(cmd), flush=True)
                statuses.append(subprocess.run(cmd, env=dict(os.environ, HF_HUB_OFFLINE="1")).returncode)
        finally:
            stop_server(proc)
    print(watch.footer())
    sys.exit(max(statuses, default=1))


if __name__ == "__main__":
    main()
