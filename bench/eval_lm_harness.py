"""lm-evaluation-harness (`lm_eval --model local-completions`) against this server, end to end, offline.

    pip install -e '.[eval]'
    python bench/eval_lm_harness.py                     # qwen3_tiny checkpoint written here, both tasks
    python bench/eval_lm_harness.py --model dsv4_tiny --limit 4

What it does: writes a tiny checkpoint (seeded random weights, a tokenizer.json and tokenizer_config.json) to a
temporary directory, starts `python -m appliance` on it (HTTP on a free port), writes two tasks defined here over
local jsonl files (nothing is downloaded: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are set), and runs lm_eval:
- `appliance_ll`: a multiple-choice task (output_type multiple_choice: loglikelihood requests, i.e. completions with
  echo, logprobs 1 and the prompt as token ids);
- `appliance_gen`: a generate_until task (completions with stop strings and max_tokens).
The weights are random, so the scores mean nothing; what is proven is that every request lm-eval sends is
answered in the shape it parses. The server is stopped at the end; the exit status is lm_eval's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.config.compose import load_runtime_config  # noqa: E402
from tests.support.checkpoints import write_tiny_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
QUESTIONS = [("The colour of the sky is", [" blue", " green", " loud"], 0),
             ("Two plus two is", [" four", " five", " seven"], 0),
             ("Water is", [" wet", " dry", " square"], 0),
             ("The sun rises in the", [" east", " west", " cellar"], 0)]
LL_TASK = """task: appliance_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN_TASK = """task: appliance_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  temperature: 0
metric_list:
  - metric: exact_match
"""


def write_tasks(directory: Path) -> None:
    """The two task YAMLs and their jsonl data, all local."""
    ll, gen = directory / "ll.jsonl", directory / "gen.jsonl"
    ll.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    gen.write_text("".join(json.dumps({"question": q, "target": c[a]}) + "\n" for q, c, a in QUESTIONS))
    (directory / "appliance_ll.yaml").write_text(LL_TASK.format(data=ll))
    (directory / "appliance_gen.yaml").write_text(GEN_TASK.format(data=gen))


def write_checkpoint(directory: Path, model: str) -> tuple[Path, list[str]]:
    """A tiny checkpoint lm-eval's AutoTokenizer can read too; the appliance overrides that serve it."""
    spec = load_runtime_config([f"+model={model}"]).model
    path = write_tiny_checkpoint(directory / model, spec, seed=5, std=0.1)
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|eos|>", "bos_token": "<|bos|>"}))
    return path, [f"+model={model}", f"model.weights={path}"]


class Server:
    """`python -m appliance` with its output read by a thread; the HTTP port from its 'http listening' line."""

    def __init__(self, overrides: list[str], run_dir: Path):
        self.proc = subprocess.Popen([sys.executable, "-m", "appliance", *overrides, f"hydra.run.dir={run_dir}"],
                                     cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    def wait_serving(self, timeout: float = 600) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            text = "".join(self.lines)
            port = re.search(r"^http listening on 127\.0\.0\.1:(\d+) ", text, re.M)
            if port and "SERVING on" in text:
                return int(port.group(1))
            time.sleep(0.2)
        raise SystemExit(f"the server did not start:\n{''.join(self.lines)}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3_tiny", help="conf/model/<name>.yaml of the tiny checkpoint")
    ap.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    ap.add_argument("--output", type=Path, default=None, help="lm_eval --output_path (default: a temp dir)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="lm_eval_") as tmp:
        tmp = Path(tmp)
        checkpoint, overrides = write_checkpoint(tmp, args.model)
        tasks = tmp / "tasks"
        tasks.mkdir()
        write_tasks(tasks)
        name = load_runtime_config(overrides).model.name
        server = Server([*overrides, "device=cpu", "max_model_len=512", "server.port=0", "server.http_port=0"],
                        tmp / "run")
        try:
            port = server.wait_serving()
            cmd = ["lm_eval", "--model", "local-completions", "--model_args",
                   f"model={name},base_url=http://127.0.0.1:{port}/v1/completions,tokenizer_backend=huggingface,"
                   f"tokenizer={checkpoint},tokenized_requests=True,num_concurrent=1,max_retries=1,max_length=512",
                   "--tasks", "appliance_ll,appliance_gen", "--include_path", str(tasks), "--batch_size", "1",
                   "--output_path", str(args.output or tmp / "results"), "--log_samples"]
            if args.limit:
                cmd += ["--limit", str(args.limit)]
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
            print("+", " ".join(cmd), flush=True)
            # In the repository: lm_eval records `git describe` of its working directory (this commit), and
            # anywhere else git prints "fatal: not a git repository" on the way.
            return subprocess.run(cmd, env=env, cwd=REPO).returncode
        finally:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
