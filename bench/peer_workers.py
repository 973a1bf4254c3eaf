#!/usr/bin/env python3
"""One system's share of bench/bench_peers.py: start it, run the listed generate calls, write what they took.

    PYTHON bench/peer_workers.py SYSTEM --spec SPEC.json --out OUT.json

SYSTEM is `appliance` (this project's offline API; run by the project's python), `vllm` (vLLM's offline
LLM; run by the vLLM venv's python) or `hf` (transformers generate). SPEC.json names the checkpoint
directory, the dtype, the torch threads and the calls: each a list of prompts (token ids) and a number of
tokens to generate greedily with the end-of-sequence token ignored (exactly that many per request). Every
system runs the same calls on the same prompts, in their order, with no warm-up call: the first call is the
first generate after the system started in this process (bench_peers.py's "cold" workload), and whatever it
warms (allocations, kernel choices, compiled graphs) serves the later calls.

OUT.json: import and start-up seconds (process start to a system that can generate), and per call its wall
seconds, output tokens and (when the spec asks) the token ids, for the greedy agreement check.

Only the standard library is imported at the top: the vLLM venv cannot import this project, and the
project's python may lack vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

PROCESS_START = time.perf_counter()


def appliance_overrides(model_dir: str, threads: int, num_requests: int, max_model_len: int = 1024) -> list[str]:
    """The offline API on a checkpoint directory (its config.json gives the layout), sized so that every
    request of a call runs at once (bench/profile_engine_step.py profiles the same settings)."""
    return ["+model=hf", f"model.weights={model_dir}", "device=cpu", f"device.cpu_threads={threads}",
            f"max_model_len={max_model_len}", f"max_num_seqs={num_requests}", f"decode_batch={num_requests}",
            f"kv_cache.num_slots_override={num_requests}", "max_num_batched_tokens=2048",
            f"max_waiting_requests={4 * num_requests}", "device.memory_bytes_per_device=8589934592",
            "server.http_port=null"]


def appliance_system(spec: dict):
    """The project's offline API on the checkpoint (layout and cache groups from its config.json)."""
    n = max(len(call["prompts"]) for call in spec["calls"])
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # this checkout's project
    from appliance.core.request import SamplingParams
    from appliance.offline import Appliance
    imported = time.perf_counter()
    app = Appliance.from_config(appliance_overrides(spec["model"], spec["threads"], n, spec["max_model_len"])
                                + spec.get("appliance_overrides", []))

    def generate(prompts: list[list[int]], gen_len: int) -> list[list[int]]:
        return [r.token_ids for r in app.generate(prompts, SamplingParams(max_tokens=gen_len, ignore_eos=True))]

    info = {"settings": "offline API, " + " ".join(appliance_overrides("DIR", spec["threads"], n,
                                                                       spec["max_model_len"])[2:])}
    return imported, generate, app.close, info


def vllm_system(spec: dict):
    """vLLM's offline LLM; the CPU thread binding comes from the environment the orchestrator sets."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    imported = time.perf_counter()
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype=spec["dtype"],
              max_model_len=spec["max_model_len"], seed=0)
    eos = spec["eos"]

    def generate(prompts: list[list[int]], gen_len: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=gen_len, min_tokens=gen_len, ignore_eos=True,
                                stop_token_ids=[eos], detokenize=False)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def close() -> None:
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - best effort: the process exits next anyway
            pass

    import vllm
    config = llm.llm_engine.vllm_config
    info = {"version": vllm.__version__, "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
            "max_num_seqs": config.scheduler_config.max_num_seqs,
            "compilation_mode": str(config.compilation_config.mode),
            "omp_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")}
    return imported, generate, close, info


def hf_system(spec: dict):
    """transformers generate, the whole call as one batch (equal prompt lengths: no padding)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig
    imported = time.perf_counter()
    torch.set_num_threads(spec["threads"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=getattr(torch, spec["dtype"])).eval()
    eos = spec["eos"]

    def generate(prompts: list[list[int]], gen_len: int) -> list[list[int]]:
        config = GenerationConfig(do_sample=False, max_new_tokens=gen_len, min_new_tokens=gen_len,
                                  eos_token_id=eos, pad_token_id=eos, bos_token_id=eos, use_cache=True)
        ids = torch.tensor(prompts, dtype=torch.long)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
        return out[:, ids.shape[1]:].tolist()

    info = {"version": transformers.__version__, "torch_threads": torch.get_num_threads()}
    return imported, generate, lambda: None, info


SYSTEMS = {"appliance": appliance_system, "vllm": vllm_system, "hf": hf_system}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("system", choices=sorted(SYSTEMS))
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    with open(a.spec) as f:
        spec = json.load(f)
    imported, generate, close, info = SYSTEMS[a.system](spec)
    ready = time.perf_counter()
    calls = []
    for call in spec["calls"]:
        t0 = time.perf_counter()
        tokens = generate(call["prompts"], call["gen_len"])
        seconds = time.perf_counter() - t0
        calls.append({"name": call["name"], "seconds": seconds, "output_tokens": sum(len(t) for t in tokens),
                      "exact_lengths": all(len(t) == call["gen_len"] for t in tokens),
                      "tokens": tokens if call.get("keep_tokens") else None})
    close()
    with open(a.out, "w") as f:
        json.dump({"system": a.system, "import_s": imported - PROCESS_START, "startup_s": ready - PROCESS_START,
                   "info": info, "calls": calls}, f)


if __name__ == "__main__":
    sys.exit(main())
