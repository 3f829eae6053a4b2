"""The attention mask and the position ids of a decoding batch's rows.

Each row's KV cache is left-padded to the batch's width: a token in column c of row j has
position c - padding[j], and the mask is 0 over the padding, 1 after it. An M-RoPE family
(Prompt.position_ids) adds each row's rope delta, and takes the same position on every
axis. The tables are made with spare columns, so that a decode step only takes a view of
its column; a lone row (no padding) takes views of tables every batch shares.
"""
from __future__ import annotations

import numpy as np

_SHARED: dict = {}  # (kind, dtype) → a read-only table every batch shares (see shared_table)


def shared_table(kind: str, dtype: np.dtype, n: int) -> np.ndarray:
    """A table of at least `n` columns that every batch shares, read-only: "ones" [1, n] is
    a lone row's mask, "counting" [n, 1, 1] (0, 1, … n-1) a lone row's position ids. A lone
    row has no padding, so it takes views of these and allocates nothing."""
    table = _SHARED.get((kind, dtype))
    if table is None or table.size < n:
        size = max(n, 2 * table.size if table is not None else 1024)
        table = np.ones((1, size), dtype) if kind == "ones" else np.arange(size, dtype=dtype)[:, None, None]
        table.flags.writeable = False
        _SHARED[(kind, dtype)] = table  # another thread may make its own: both are right
    return table


def padded_rows(padding: np.ndarray, capacity: int, mask_dtype: np.dtype,
                position_dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The mask [R, capacity] and the position table [capacity, R, 1] of rows left-padded by
    `padding` [R]."""
    counting = shared_table("counting", position_dtype, capacity)[:capacity]  # [capacity, 1, 1]
    positions = counting - padding[:, None]  # [capacity, R, 1]
    mask = (counting[:, 0, 0] >= padding[:, None]).astype(mask_dtype)  # [R, capacity]
    return mask, positions


def family_positions(positions: np.ndarray, deltas: np.ndarray | None, axes: int) -> np.ndarray:
    """The position table [capacity, R, 1] as an M-RoPE family's decode steps take it: each
    row's rope delta added, and (with `axes`) the same position on every axis, laid out
    [capacity, axes, R, 1] so that one column is a packed [axes, R, 1]."""
    if deltas is not None:
        positions = positions + deltas[:, None]
    if axes:
        positions = np.ascontiguousarray(np.broadcast_to(positions[:, None], (len(positions), axes,
                                                                              *positions.shape[1:])))
    return positions


def prompt_positions(axes: int, own: list[np.ndarray | None], counting: np.ndarray) -> np.ndarray:
    """[axes, B, S] for prompts of one length: each row the family's (`own`, its
    Prompt.position_ids), or 0 … S-1 on every axis for a prompt without."""
    rows = [positions if positions is not None else np.broadcast_to(counting, (axes, 1, counting.shape[1]))
            for positions in own]
    return rows[0] if len(rows) == 1 else np.concatenate(rows, axis=1)


def unpadded_mask(rows: int, length: int, dtype: np.dtype) -> np.ndarray:
    """A mask without padding: a lone row's is a view of the shared table."""
    return shared_table("ones", dtype, length)[:, :length] if rows == 1 else np.ones((rows, length), dtype)
