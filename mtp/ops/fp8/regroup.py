"""Regrouping the rows of block-scaled FP8 weights on the host, exactly.

A checkpoint layout may build one of the model's weights from rows of several checkpoint
tensors (Qwen3.5's ``in_proj_qkv`` and ``in_proj_z`` interleave per key-head group into
``in_proj_qkvz``; fused experts split into gate and up) and split it back on save. With FP8
tensors the rows carry their block's scale. Where the rows move in whole aligned blocks, the
blocks move with them and the weight keeps its 128 x 128 blocks. Where they do not (a head
dim that is not a multiple of 128, as in small test models), each row keeps its own copy of
its block's scale: a ``(1, 128)`` block (``ceil(in / 128)`` scales a row, 1/32 byte per
weight), still 8-bit and still exact. `to_block_rows` returns to whole blocks on save, which
succeeds for any rows a checkpoint's blocks produced.
"""

from __future__ import annotations

import numpy as np

from mtp.ops.fp8.reference import BlockFp8Weight


def _row_scales(w: BlockFp8Weight) -> np.ndarray:
    """``w``'s scales with one row of them per weight row: ``[..., out, ceil(in / bi)]``."""
    return np.repeat(np.asarray(w.scale_inv), w.block[0], axis=-2)[..., :w.shape[-2], :]


def _per_row(w: BlockFp8Weight) -> BlockFp8Weight:
    return BlockFp8Weight(np.asarray(w.values), _row_scales(w), (1, w.block[1]), w.scale_dtype)


def _moves_whole_blocks(rows: np.ndarray, source_rows: int, block: int) -> bool:
    """Whether ``rows`` (source row indices, in order) is a sequence of whole, aligned source blocks."""
    for start in range(0, len(rows), block):
        chunk = rows[start:start + block]
        first = int(chunk[0])
        want = np.arange(first, min(first + block, source_rows))
        if first % block or len(chunk) != len(want) or not np.array_equal(chunk, want):
            return False
    return True


def take_rows(w: BlockFp8Weight, rows) -> BlockFp8Weight:
    """The weight made of ``w``'s rows ``rows`` (in that order), exactly; whole blocks kept where they move whole."""
    rows = np.asarray(rows, np.int64)
    values = np.asarray(w.values)
    if _moves_whole_blocks(rows, w.shape[-2], w.block[0]):
        return BlockFp8Weight(values[..., rows, :], np.asarray(w.scale_inv)[..., rows[::w.block[0]] // w.block[0], :],
                              w.block, w.scale_dtype)
    per_row = _per_row(w)
    return BlockFp8Weight(values[..., rows, :], per_row.scale_inv[..., rows, :], per_row.block, w.scale_dtype)


def concat_rows(ws: list[BlockFp8Weight]) -> BlockFp8Weight:
    """The weights stacked along their rows, exactly; their blocks kept where every one but the last fills whole blocks."""
    block, dtype = ws[0].block, ws[0].scale_dtype
    if any(w.block[1] != block[1] or w.scale_dtype != dtype for w in ws):
        raise ValueError(f"cannot join FP8 weights of column blocks / scale dtypes "
                         f"{[(w.block[1], w.scale_dtype) for w in ws]}")
    if any(w.block != block for w in ws) or any(w.shape[-2] % block[0] for w in ws[:-1]):
        ws = [_per_row(w) for w in ws]
    return BlockFp8Weight(np.concatenate([np.asarray(w.values) for w in ws], axis=-2),
                          np.concatenate([np.asarray(w.scale_inv) for w in ws], axis=-2), ws[0].block, dtype)


def to_block_rows(w: BlockFp8Weight, block_rows: int, name: str = "weight") -> BlockFp8Weight:
    """``w`` with ``block_rows``-row blocks; a ValueError naming ``name`` if its rows' scales differ inside one."""
    if w.block[0] == block_rows:
        return w
    rows = _row_scales(w)
    blocks = np.asarray(rows[..., ::block_rows, :])
    if not np.array_equal(np.repeat(blocks, block_rows, axis=-2)[..., :w.shape[-2], :], rows):
        raise ValueError(f"{name}: its FP8 scales differ inside a {block_rows}-row block, so it cannot be "
                         f"written with {block_rows} x {w.block[1]} blocks")
    return BlockFp8Weight(np.asarray(w.values), blocks, (block_rows, w.block[1]), w.scale_dtype)


def stack(ws: list[BlockFp8Weight]) -> BlockFp8Weight:
    """Weights of one shape and block (per-expert tensors) as one ``[E, ...]`` weight: each keeps its own scales."""
    if len({(w.shape, w.block, w.scale_dtype) for w in ws}) != 1:
        raise ValueError(f"cannot stack FP8 weights of shapes / blocks {[(w.shape, w.block) for w in ws]}")
    return BlockFp8Weight(np.stack([np.asarray(w.values) for w in ws]), np.stack([np.asarray(w.scale_inv) for w in ws]),
                          ws[0].block, ws[0].scale_dtype)


def unstack(w: BlockFp8Weight) -> list[BlockFp8Weight]:
    """The inverse of `stack`: each of the leading axis' weights."""
    values, scales = np.asarray(w.values), np.asarray(w.scale_inv)
    return [BlockFp8Weight(values[e], scales[e], w.block, w.scale_dtype) for e in range(values.shape[0])]
