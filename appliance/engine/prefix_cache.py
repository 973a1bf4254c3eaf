"""Chained block hashes for prefix caching: H_j = blake2b[tag](H_{j-1} || token ids of block j).

Each hash names a whole prefix (not just one block), so equal hashes mean equal token prefixes. hashlib,
never Python's hash(): stable across processes and runs, and the domain tag keeps these digests apart
from any other blake2b use.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from typing import Sequence

PREFIX_HASH_TAG = b"appliance.kv.v1"   # blake2b personalization (domain tag), at most 16 bytes
ROOT_HASH = bytes(32)                  # H_{-1}: the parent of the first block


def hash_block(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Hash of one block given its parent's hash; token ids as little-endian int64 (machine independent)."""
    data = array("q", tokens)
    if sys.byteorder == "big":
        data.byteswap()
    h = hashlib.blake2b(parent, digest_size=32, person=PREFIX_HASH_TAG)
    h.update(data.tobytes())
    return h.digest()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                        num_blocks: int) -> list[bytes]:
    """Append the hashes of blocks len(hashes) .. num_blocks - 1 to `hashes` (in place) and return it."""
    if num_blocks * block_size > len(token_ids):
        raise ValueError(f"{num_blocks} blocks of {block_size} tokens need {num_blocks * block_size} token ids, "
                         f"got {len(token_ids)}")
    for j in range(len(hashes), num_blocks):
        hashes.append(hash_block(hashes[-1] if hashes else ROOT_HASH,
                                 token_ids[j * block_size:(j + 1) * block_size]))
    return hashes
