"""Paged attention through torch_npu's fused kernel, for runners on an Ascend NPU.

What runs: torch_npu.npu_fused_infer_attention_score, once per layer for every row of a step (decode rows
and prefill chunks together, TND layout with cumulative query lengths), reading K and V straight from the
pool through a block table, causal per sequence by sparse_mode=3 with the kernel's compressed 2048 x 2048
bool mask. That is the call vllm-ascend makes for chunked prefill on CANN 8.3
(vllm_ascend/attention/attention_v1.py, `_forward_v1_style`).

Why this kernel and not torch_npu's scaled_dot_product_attention: SDPA needs K and V as dense tensors, so a
step would first gather every sequence's pages (the copy this kernel exists to avoid) and, whenever a mask
is needed, pass it at full [rows, context] size; the fused kernel takes the block table and the lengths.
Why not _npu_paged_attention (vllm-ascend's decode kernel): it takes decode rows only, so a step with
prefill chunks would need a second kernel and a split batch; one call keeps the runner's flat batch.

What it needs from the pool: K and V of a page as two contiguous [block_size, kv_heads x head_dim] planes,
so that a layer's pool viewed as [2 x pages, block_size, H] is the kernel's paged cache: the K plane of
page p is block 2p, its V plane 2p + 1. Passing key = view[:-1] and value = view[1:] (same shape, value
offset by one plane) lets one block table (2p per page) address both with no copy.

Where it applies (fused_attention_op): the runner's device is an NPU, activations are float16 or bfloat16
and block_size is a multiple of 16 up to 512 (the kernel's page-attention limits). Anywhere else, the
runner's SDPA path runs unchanged, so the CPU path (and the transformers oracles) never see this module.
There is no NPU in CI: tests/npu/test_fused_paths.py runs the runner with this module over a reference
implementation of the kernel's documented semantics and checks it against the SDPA path.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from npu.backends import import_torch_npu

log = logging.getLogger("npu.fused_attention")

MASK_SIZE = 2048          # sparse_mode 3 takes this compressed lower-right causal mask (True = masked out)
BLOCK_MULTIPLE = 16
MAX_BLOCK_SIZE = 512


@dataclass(frozen=True)
class FusedStep:
    """One step's arguments shared by every layer: sequences in the flat batch's order."""

    block_table: torch.Tensor      # [seqs, most K planes] int32: 2 x page id (the K plane of each page), padded with 0
    query_ends: list[int]          # cumulative query rows per sequence (TND actual_seq_lengths)
    kv_lengths: list[int]          # tokens each sequence attends to, this step's included


def fused_attention_op(device: torch.device, dtype: torch.dtype, block_size: int) -> Callable | None:
    """torch_npu's fused paged-attention kernel where it applies to a runner, else None (and why, logged)."""
    if device.type != "npu":
        return None
    if dtype not in (torch.float16, torch.bfloat16):
        log.info("fused paged attention off: it needs float16 or bfloat16 activations, not %s", dtype)
        return None
    if block_size % BLOCK_MULTIPLE or block_size > MAX_BLOCK_SIZE:
        log.info("fused paged attention off: block_size %d is not a multiple of %d up to %d", block_size,
                 BLOCK_MULTIPLE, MAX_BLOCK_SIZE)
        return None
    import_torch_npu()                                # the NPU backend's importer names the install on failure
    import torch_npu
    return torch_npu.npu_fused_infer_attention_score


class FusedPagedAttention:
    """Attention of a step's rows over one layer's paged K/V, by the fused kernel `op`."""

    def __init__(self, op: Callable, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 device: torch.device):
        self.op = op
        self.num_heads, self.num_kv_heads, self.head_dim, self.block_size = num_heads, num_kv_heads, head_dim, block_size
        self.mask = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=device).triu(diagonal=1)

    def __call__(self, query: torch.Tensor, planes: torch.Tensor, step: FusedStep) -> torch.Tensor:
        """query [rows, heads, head_dim]; planes: one layer's pool as [2 x pages, block_size, kv_heads x head_dim].
        Returns [rows, heads, head_dim]."""
        out, _ = self.op(
            query.contiguous(), planes[:-1], planes[1:], atten_mask=self.mask, block_table=step.block_table,
            input_layout="TND", block_size=self.block_size, actual_seq_lengths=step.query_ends,
            actual_seq_lengths_kv=step.kv_lengths, num_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
            scale=1.0 / math.sqrt(self.head_dim), sparse_mode=3)
        return out
