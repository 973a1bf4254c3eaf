"""Chained block hashes for prefix caching: H_j = blake2b[tag](H_{j-1} || token ids of block j).

Each hash names a whole prefix (not just one block), so equal hashes mean equal token prefixes. hashlib,
never Python's hash(): stable across processes and runs, and the domain tag keeps these digests apart
from any other blake2b use. A block may be keyed by the prompt's length too (one more int64 after its tokens:
appliance/core/prefix_reuse.py), and every later block with it, through the chain.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from typing import Sequence

PREFIX_HASH_TAG = b"appliance.kv.v1"   # blake2b personalization (domain tag), at most 16 bytes
ROOT_HASH = bytes(32)                  # H_{-1}: the parent of the first block


def hash_block(parent: bytes, tokens: Sequence[int], prompt_len: int | None = None) -> bytes:
    """Hash of one block given its parent's hash; token ids as little-endian int64 (machine independent), then
    the prompt's length when given (a block of one more int64 than any plain block: no plain hash equals it)."""
    data = array("q", tokens)
    if prompt_len is not None:
        data.append(prompt_len)
    if sys.byteorder == "big":
        data.byteswap()
    h = hashlib.blake2b(parent, digest_size=32, person=PREFIX_HASH_TAG)
    h.update(data.tobytes())
    return h.digest()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int, num_blocks: int,
                        length_keyed: tuple[int, int] | None = None) -> list[bytes]:
    """Append the hashes of blocks len(hashes) .. num_blocks - 1 to `hashes` (in place) and return it.
    length_keyed = (block j, prompt length): block j's hash includes the length (so every later one does)."""
    if num_blocks * block_size > len(token_ids):
        raise ValueError(f"{num_blocks} blocks of {block_size} tokens need {num_blocks * block_size} token ids, "
                         f"got {len(token_ids)}")
    keyed_block, prompt_len = length_keyed if length_keyed is not None else (-1, None)
    for j in range(len(hashes), num_blocks):
        hashes.append(hash_block(hashes[-1] if hashes else ROOT_HASH, token_ids[j * block_size:(j + 1) * block_size],
                                 prompt_len if j == keyed_block else None))
    return hashes
