"""Is this host's memory speed steady? A model's projections at batch 1, back to back, in short windows over time.

    python bench/probe_host_cache.py                      # the 6 x 768 model's 25 bf16 projections (171 MB), 12 windows
    python bench/probe_host_cache.py --shape 4x512 --dtype float32 --windows 30

A batch-1 decode step reads every weight once, so its projections run at the speed the weights arrive: from the
last-level cache when they fit in the share of it this process gets, else from DRAM. On a host whose cache other
tenants share, that share changes from second to second, and so does every decode-bound figure measured there. Each
window prints the fastest and the median of 50 passes over the weights (oneDNN packed, as npu/linear.py runs them)
and the weights' bytes per median pass: two levels far apart (say 50 and 20 GB/s) mean figures taken on this host
mix two machines. Nothing else should run meanwhile.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_shapes import SHAPES, VOCAB
from report import cpu_and_load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="6x768", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--windows", type=int, default=12)
    ap.add_argument("--passes", type=int, default=50)
    ap.add_argument("--pause", type=float, default=2.0, help="seconds between windows")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    shape, dtype = SHAPES[a.shape], getattr(torch, a.dtype)
    q, kv = shape.heads * shape.head_dim, 2 * shape.kv_heads * shape.head_dim
    layer = [(q + kv, shape.hidden), (shape.hidden, q), (2 * shape.inter, shape.hidden), (shape.hidden, shape.inter)]
    weights = layer * shape.layers + [(VOCAB, shape.hidden)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(o, i).to(dtype), 64) for o, i in weights]
    inputs = {i: torch.randn(1, i).to(dtype) for _, i in weights}
    gigabytes = sum(o * i for o, i in weights) * packed[0].element_size() / 1e9
    print(f"{cpu_and_load()}; {a.shape} {a.dtype}: {len(weights)} projections, {gigabytes * 1e3:.0f} MB of weights, "
          f"{a.threads} threads")
    for _ in range(a.windows):
        times = []
        for _ in range(a.passes):
            start = time.perf_counter()
            for (_, i), w in zip(weights, packed):
                torch.ops.mkldnn._linear_pointwise(inputs[i], w, None, "none", [], "")
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        print(f"{time.strftime('%H:%M:%S')}  fastest {min(times) * 1e3:6.2f} ms  median {median * 1e3:6.2f} ms  "
              f"{gigabytes / median:5.1f} GB/s", flush=True)
        time.sleep(a.pause)


if __name__ == "__main__":
    main()
