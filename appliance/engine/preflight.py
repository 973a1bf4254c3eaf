"""Preflight: every startup check that needs no device work, run before a server binds its port.

Serve, bench and the offline API all start an Engine, and Engine.start() runs this first (a server runs it
through Engine.prepare() before binding). In order, cheapest first:

1. the checkpoint's files, torch-free (appliance.core.checkpoint_files): the weights directory, config.json
   against model.layout, every safetensors header;
2. the backend (npu.launcher.prepare_rank): the device kind is importable and visible (device=auto says
   which it chose and why), and this rank's device can hold its shard of the weights estimated from the layout;
3. the runner of that shard (no weights yet), and the checkpoint's tensor names and shapes against the ones it
   expects;
4. the tokenizer: tokenizer.json loads and fits the vocabulary (or, for random weights, it is built).

Each fault is a StartupError naming the file, key or device and the fix (the CLI exits 2). The backend,
runner and tokenizer opened here are what the engine then starts with.
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.core.checkpoint_files import check_checkpoint_files
from appliance.core.config import RuntimeConfig
from appliance.core.parallel import place_of
from appliance.core.tokenizer import Tokenizer, load_tokenizer_for
from npu.backends import Backend
from npu.launcher import prepare_rank
from npu.ranks import owner_rendezvous
from npu.runner import ModelRunner


@dataclass(frozen=True)
class Preflight:
    """What the checks opened: the engine starts this runner (weights not loaded yet) on this backend, with
    this tokenizer."""

    backend: Backend
    runner: ModelRunner
    tokenizer: Tokenizer


def preflight(rc: RuntimeConfig) -> Preflight:
    """The checks for this process's rank (the owner: rank 0, or torchrun's RANK); the other ranks run the
    device-plane ones themselves (npu.worker) and report failures through the rendezvous."""
    check_checkpoint_files(rc.model)
    rank, local_index = owner_rendezvous()
    backend, runner = prepare_rank(rc, place_of(rc.parallel, rank), local_index)
    return Preflight(backend, runner, load_tokenizer_for(rc.model))
