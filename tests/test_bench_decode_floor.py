"""bench/profile_decode_floor.py on a tiny Qwen3 checkpoint: a row per projection shape and the attention, with the
bytes each reads per step as the layout says (the weights once per call, every row's K and V once per layer)."""

from __future__ import annotations

import re
import subprocess
import sys

from appliance.config.compose import load_runtime_config
from tests.conftest import REPO
from tests.support.checkpoints import write_tiny_checkpoint


def test_the_floor_table_counts_each_parts_bytes(tmp_path):
    model = load_runtime_config(["+model=qwen3_tiny"]).model
    write_tiny_checkpoint(tmp_path / "ckpt", model, seed=0)
    batch, context, steps = 4, 20, 3
    run = subprocess.run([sys.executable, "bench/profile_decode_floor.py", "--model", str(tmp_path / "ckpt"),
                          "--batch", str(batch), "--context", str(context), "--steps", str(steps), "--threads", "1",
                          "--stream-mib", "16", "--matmul-n", "128"],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = {m.group(1): float(m.group(2))
            for m in re.finditer(r"^\| ([^|]+?) \| [\d.]+ \| ([\d.e+-]+) \|", run.stdout, re.M)}
    lay = model.layout
    size = 4 if lay.dtype == "float32" else 2
    q, kv = lay.num_heads * lay.head_dim, lay.num_kv_heads * lay.head_dim
    expected = {                                                # MB read per step: every layer's call, the head once
        f"projection {q + 2 * kv} x {lay.hidden_size}": lay.num_layers * (q + 2 * kv) * lay.hidden_size * size,
        f"projection {lay.hidden_size} x {q}": lay.num_layers * lay.hidden_size * q * size,
        f"projection {2 * lay.intermediate_size} x {lay.hidden_size}":
            lay.num_layers * 2 * lay.intermediate_size * lay.hidden_size * size,
        f"projection {lay.hidden_size} x {lay.intermediate_size}":
            lay.num_layers * lay.hidden_size * lay.intermediate_size * size,
        f"projection {lay.vocab_size} x {lay.hidden_size}": lay.vocab_size * lay.hidden_size * size,
        "decode attention": lay.num_layers * batch * (context + (steps - 1) / 2) * 2 * kv * size,
    }
    assert set(rows) == set(expected), run.stdout
    for name, read in expected.items():
        assert abs(rows[name] - read / 1e6) <= 1e-3 * read / 1e6, (name, rows[name], read / 1e6)
    assert "the step's floor" in run.stdout
