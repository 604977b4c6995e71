"""The signed trees that make a share attributable to its dealer (:mod:`.secagg`): each site signs,
once per round, the root of a Merkle tree over one leaf per holder of its shares."""

from __future__ import annotations

import hashlib
import json

from .secagg_ring import PROTOCOL

# --- a dealer's shares, attributable to it ----------------------------------------------------------
# Each site signs, once per round, the root of a Merkle tree (SHA-256, leaves and nodes told apart by
# a prefix) over one leaf per holder of its shares: the holder's name, the share's index and the
# SHA-256 of each of its two shares. A holder checks its leaf's path to the signed root when the
# shares arrive; when it reveals one share it sends the path and the other share's hash, so the
# aggregator can tell a share its dealer signed (a bad one blames the dealer) from one the holder
# altered (it blames the holder), without ever seeing the other share.
EMPTY_LEAF = hashlib.sha256(b"fedcontrast secagg: no holder").digest()
MAX_DEPTH = 16


def share_hash(kind: str, share: bytes) -> bytes:
    """The hash of one share (``kind`` b or s) inside its holder's leaf."""
    return hashlib.sha256(PROTOCOL.encode() + b"|share|" + kind.encode() + b"|" + share).digest()


def leaf(holder: str, index: int, b_hash: bytes, s_hash: bytes) -> bytes:
    return hashlib.sha256(b"\0" + json.dumps([holder, int(index)]).encode() + b_hash + s_hash).digest()


def _node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\1" + left + right).digest()


def tree_depth(holders: int) -> int:
    """The depth of the tree over ``holders`` leaves (padded to a power of two)."""
    return max(0, (holders - 1).bit_length())


def merkle_tree(leaves: list[bytes]) -> list[list[bytes]]:
    """Every level of the tree over ``leaves`` (padded to a power of two), the leaves first."""
    level = leaves + [EMPTY_LEAF] * ((1 << tree_depth(len(leaves))) - len(leaves))
    levels = [level]
    while len(level) > 1:
        level = [_node(level[i], level[i + 1]) for i in range(0, len(level), 2)]
        levels.append(level)
    return levels


def merkle_path(levels: list[list[bytes]], position: int) -> bytes:
    """The siblings of leaf ``position`` from the bottom up, concatenated."""
    return b"".join(level[(position >> depth) ^ 1] for depth, level in enumerate(levels[:-1]))


def merkle_root_of(leaf_hash: bytes, position: int, path: bytes) -> bytes | None:
    """The root that ``leaf_hash`` at ``position`` and its ``path`` lead to (None: a malformed path)."""
    if len(path) % 32 or len(path) // 32 > MAX_DEPTH or not 0 <= position < 1 << (len(path) // 32):
        return None
    node = leaf_hash
    for depth in range(len(path) // 32):
        sibling = path[32 * depth:32 * depth + 32]
        node = _node(sibling, node) if position >> depth & 1 else _node(node, sibling)
    return node
