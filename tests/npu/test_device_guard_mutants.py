"""The fake-CUDA guard (tests/npu/test_device_guard.py) fails with each bug the first run on a real GPU found re-planted
(issue 36): the guard is only worth its place if these two come back red.

1. Qwen3's decode attention took `.view` of SDPA's output, which CUDA's fused kernels lay out differently from the
   CPU kernel ("view size is not compatible with input tensor's size and stride").
2. DeepSeek V4's indexer broke top-k ties by indexing a host tensor with a device mask (`ranked[tied]`: "indices
   should be either on cpu or on the same device as the indexed tensor"), after a host sync (`bool(tied.any())`).
   Re-planted as the code was at acfe195 (below, verbatim).
Each is re-planted in-process (the method rebuilt from its source with the old line) and the guard's own tests run.
"""

from __future__ import annotations

import inspect
import textwrap

import pytest

import npu.deepseek_v4.attention
import npu.qwen3.runner
from npu.deepseek_v4.attention import Attention
from npu.qwen3.runner import Qwen3Runner
from tests.npu import test_device_guard as guard

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# npu/deepseek_v4/attention.py Attention._index at acfe195, the version that crashed on an H200.
OLD_INDEX = """
def _index(self, layer: int, group: QueryGroup, q: torch.Tensor, head_w: torch.Tensor) -> Rows | None:
    di, ratio, topk = self.lay.index_head_dim, self.csa, self.lay.index_topk
    visible = group.visible[ratio]
    ranked = group.ranked_end // ratio                                                 # [S, Q] T per query
    lengths = ranked.flatten().tolist()
    k = min(topk, max(lengths, default=0))
    if k == 0:
        return None
    keys = self.io.read("idx", layer, group.keys["idx"], di, torch.float32)               # [S, Kc, di]
    dots = torch.einsum("sqhd,skd->sqhk", group.view(q).float(), keys).relu_().mul_(di ** -0.5)   # in place:
    score = dots.mul_(group.view(head_w)[..., None]).sum(dim=2)                # one [S, Q, heads, Kc] tensor
    del dots
    width = max(max(lengths), score.shape[-1])
    score = F.pad(score.masked_fill(~visible, float("-inf")), (0, width - score.shape[-1]), value=float("-inf"))
    top = score.topk(min(k + 1, width), dim=-1)              # one call for the group: the k best of each query
    order = top.indices[..., :k]                              # are the same set under any tie rule unless the
    if k < width:                                             # k-th and the (k + 1)-th score are equal
        kth = top.values[..., k - 1]
        tied = (kth == top.values[..., k]) & (kth > float("-inf"))                          # [S, Q]
        if bool(tied.any()):                                  # then: transformers' call, on the query's row
            for length in set(ranked[tied].tolist()):
                s_at, q_at = (tied & (ranked == length)).nonzero(as_tuple=True)
                order[s_at, q_at] = score[s_at, q_at, :length].topk(k, dim=-1).indices   # (length > k: tied)
    ok = score.gather(-1, order) > float("-inf")
    where = group.keys[self.kinds[ratio].outputs[0]]                                   # [S, Kc]
    inside = order.clamp(max=where.page.shape[1] - 1)                  # rows past Kc are -inf: not ok
    pick = lambda t: t.gather(1, inside.flatten(1)).view_as(order)  # noqa: E731
    return Rows(pick(where.page), pick(where.row), ok)
"""


def rebuilt(function, module, source: str):
    """`function`'s replacement compiled from `source` in `module`'s namespace."""
    namespace: dict = {}
    exec(compile(textwrap.dedent(source), inspect.getsourcefile(module), "exec"), vars(module), namespace)
    return namespace[function.__name__]


def test_qwen3_view_of_sdpa_output_fails_the_guard(monkeypatch):
    fixed = "attn_mask=d.mask).reshape(d.count, nh, hd)"
    source = inspect.getsource(Qwen3Runner._attend)
    assert fixed in source, "the fixed line moved: update this mutant"
    monkeypatch.setattr(Qwen3Runner, "_attend", rebuilt(Qwen3Runner._attend, npu.qwen3.runner,
                                                        source.replace(fixed, "attn_mask=d.mask).view(d.count, nh, hd)")))
    with pytest.raises(Exception, match="view"):
        guard.test_serving_steps_run_on_the_device_alone(guard.QWEN3_GATHER)


def test_dsv4_host_tensor_indexed_by_a_device_mask_fails_the_guard(monkeypatch):
    monkeypatch.setattr(Attention, "_index", rebuilt(Attention._index, npu.deepseek_v4.attention, OLD_INDEX))
    with pytest.raises(Exception, match="host sync|indexed by a device tensor"):
        guard.test_serving_steps_run_on_the_device_alone(guard.DSV4)
