"""Index plans for the batch-invariant torch attention: query units, key tiles and masks.

A sequence's query rows are cut into units (at most BLOCK_POSITIONS positions); a unit's rows are
(position, query head of the group) pairs padded to a multiple of ROW_ALIGN. Keys are cut into
tiles of `tile_keys(page_size)` keys from position 0. Small units are batched as (unit, tile)
items; big units are computed one at a time against their sequence's gathered keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay.kernels.errors import KernelError
from kvrelay.kernels.metadata import AttentionMetadata

TILE_KEYS = 128  # target keys per tile; fixed so every P@V contraction has the same length
ROW_ALIGN = 4  # MKL gives bitwise-identical rows when a matmul's row count is a multiple of 4
SMALL_ROWS = 64  # units with at most this many rows are batched as items
BLOCK_POSITIONS = 128  # query positions per unit of a long chunk


def tile_keys(page_size: int) -> int:
    """Keys per tile: a whole number of pages near TILE_KEYS."""
    return page_size * max(1, TILE_KEYS // page_size)


def _align(n: int) -> int:
    return -(-n // ROW_ALIGN) * ROW_ALIGN


def _small_rows(n: int) -> int:
    """Row class of a small unit: a power of two >= ROW_ALIGN, so few classes exist."""
    r = ROW_ALIGN
    while r < n:
        r *= 2
    return r


@dataclass(slots=True)
class SmallGroup:
    """Small units with the same padded row count, flattened into (unit, tile) items."""

    rows: int
    num_units: int
    num_items: int
    blocks: torch.Tensor  # long [num_items * pages_per_tile]
    unit_of_item: torch.Tensor  # long [num_items], items ordered by (unit, tile)
    q_rows: torch.Tensor  # long [num_items, rows]: row of the per-head query table
    mask_idx: torch.Tensor  # long: flat indices of [num_items, rows, tile] to set to -inf
    vzero_rows: torch.Tensor  # long: key rows of [num_items * tile] past the context
    out_rows: torch.Tensor  # long: destination rows (token * group + g)
    src_rows: torch.Tensor  # long: source rows (unit * rows + r)


@dataclass(slots=True)
class BigUnit:
    """A block of up to BLOCK_POSITIONS query positions of one sequence."""

    q_rows: torch.Tensor  # long [rows]
    num_tiles: int
    mask_start: int  # tile-aligned; keys before this column are visible to every row
    mask: torch.Tensor  # bool [rows, num_tiles * tile - mask_start]
    out_rows: torch.Tensor  # long [valid rows]; the unit's first rows are the valid ones


@dataclass(slots=True)
class BigSeq:
    """A sequence whose long chunk is computed unit by unit over its gathered keys."""

    blocks: torch.Tensor  # long [num_tiles * pages_per_tile]
    context_len: int
    units: list[BigUnit]


@dataclass(slots=True)
class AttentionPlan:
    num_tokens: int
    group: int
    tile: int
    small: list[SmallGroup]
    big: list[BigSeq]


def get_plan(
    meta: AttentionMetadata,
    page_size: int,
    group: int,
    num_blocks: int,
    num_tokens: int,
    window: int = 0,
) -> AttentionPlan:
    """The cached plan for this metadata and attention window (built on first use, shared by
    all layers with that window)."""
    key = ("torch", page_size, group, num_blocks, num_tokens, window)
    plan = meta.plans.get(key)
    if plan is None:
        plan = build_plan(meta, page_size, group, num_blocks, num_tokens, window)
        meta.plans[key] = plan
    return plan


def build_plan(
    meta: AttentionMetadata,
    page_size: int,
    group: int,
    num_blocks: int,
    num_tokens: int,
    window: int = 0,
) -> AttentionPlan:
    """Cut every sequence's query rows into units and list their key tiles. window > 0 also
    masks the keys at or before p - window for the row at position p (the tiles stay those of
    full attention: a fully masked tile adds exact zeros)."""
    ctx = meta.context_lens.tolist()
    qsl = meta.query_start_loc.tolist()
    tables = meta.block_tables.tolist()
    if qsl[0] != 0 or qsl[-1] != num_tokens:
        raise KernelError(f"query_start_loc must run from 0 to {num_tokens}, got {qsl}")
    tile = tile_keys(page_size)
    small: dict[int, list[tuple]] = {}
    big: dict[int, list[tuple]] = {}
    for i, length in enumerate(ctx):
        n = qsl[i + 1] - qsl[i]
        if n < 0 or n > length:
            raise KernelError(f"sequence {i}: {n} query rows but context length {length}")
        num_pages = -(-length // page_size)
        if num_pages > len(tables[i]):
            raise KernelError(f"sequence {i}: context {length} exceeds its block table")
        used = tables[i][:num_pages]
        if used and not 0 <= min(used) <= max(used) < num_blocks:
            raise KernelError(f"sequence {i}: block ids {used} outside the pool of {num_blocks}")
        if n == 0:
            continue
        step = n if n * group <= SMALL_ROWS else BLOCK_POSITIONS
        for j0 in range(0, n, step):
            npos = min(step, n - j0)
            unit = (i, qsl[i] + j0, length - n + j0, npos, length)
            if npos * group <= SMALL_ROWS:
                small.setdefault(_small_rows(npos * group), []).append(unit)
            else:
                big.setdefault(i, []).append(unit)
    pages_per_tile = tile // page_size
    args = (tables, num_tokens, group, tile, page_size, pages_per_tile, window)
    return AttentionPlan(
        num_tokens=num_tokens,
        group=group,
        tile=tile,
        small=[_small_group(rows, units, *args) for rows, units in sorted(small.items())],
        big=[_big_seq(units, *args) for units in big.values()],
    )


def _tile_blocks(table: list[int], length: int, t: int, page_size: int, ppt: int) -> list[int]:
    """Block ids of tile t; pages past the context repeat the last page (masked anyway)."""
    last = -(-length // page_size) - 1
    return [table[min(t * ppt + q, last)] for q in range(ppt)]


def _unit_rows(t0: int, npos: int, rows: int, group: int, num_tokens: int) -> list[int]:
    """Query-table rows of a unit; padding rows read the zero row at num_tokens * group."""
    pad = num_tokens * group
    return [(t0 + r // group) * group + r % group if r < npos * group else pad for r in range(rows)]


def _row_positions(p0: int, npos: int, rows: int, group: int) -> torch.Tensor:
    """Position of each row; padding rows copy the last real row so they mask like it."""
    j = torch.clamp(torch.arange(rows) // group, max=npos - 1)
    return p0 + j


def _hidden(kpos: torch.Tensor, pos: torch.Tensor, window: int) -> torch.Tensor:
    """Keys a row at `pos` does not see (broadcast): later ones, and those out of its window."""
    hidden = kpos > pos
    return hidden | (kpos <= pos - window) if window > 0 else hidden


def _small_group(
    rows, units, tables, num_tokens, group, tile, page_size, ppt, window
) -> SmallGroup:
    blocks: list[int] = []
    unit_of_item: list[int] = []
    item_tile: list[int] = []
    item_len: list[int] = []
    q_rows: list[list[int]] = []
    out_rows: list[int] = []
    src_rows: list[int] = []
    row_pos: list[torch.Tensor] = []
    for u, (i, t0, p0, npos, length) in enumerate(units):
        num_tiles = (p0 + npos - 1) // tile + 1
        for t in range(num_tiles):
            blocks += _tile_blocks(tables[i], length, t, page_size, ppt)
            unit_of_item.append(u)
            item_tile.append(t)
            item_len.append(length)
        q_rows.append(_unit_rows(t0, npos, rows, group, num_tokens))
        row_pos.append(_row_positions(p0, npos, rows, group))
        out_rows += range(t0 * group, (t0 + npos) * group)
        src_rows += range(u * rows, u * rows + npos * group)
    uoi = torch.tensor(unit_of_item, dtype=torch.long)
    kpos = torch.tensor(item_tile)[:, None] * tile + torch.arange(tile)  # [items, tile]
    mask = _hidden(kpos[:, None, :], torch.stack(row_pos)[uoi][:, :, None], window)
    vzero = kpos >= torch.tensor(item_len)[:, None]
    return SmallGroup(
        rows=rows,
        num_units=len(units),
        num_items=len(unit_of_item),
        blocks=torch.tensor(blocks, dtype=torch.long),
        unit_of_item=uoi,
        q_rows=torch.tensor(q_rows, dtype=torch.long)[uoi],
        mask_idx=mask.flatten().nonzero().flatten(),
        vzero_rows=vzero.flatten().nonzero().flatten(),
        out_rows=torch.tensor(out_rows, dtype=torch.long),
        src_rows=torch.tensor(src_rows, dtype=torch.long),
    )


def _big_seq(units, tables, num_tokens, group, tile, page_size, ppt, window) -> BigSeq:
    i, length = units[0][0], units[0][4]
    big_units = []
    for _, t0, p0, npos, _ in units:
        rows = _align(npos * group)
        num_tiles = (p0 + npos - 1) // tile + 1
        start = 0 if window > 0 else (p0 + 1) // tile * tile
        kpos = torch.arange(start, num_tiles * tile)
        big_units.append(
            BigUnit(
                q_rows=torch.tensor(_unit_rows(t0, npos, rows, group, num_tokens)),
                num_tiles=num_tiles,
                mask_start=start,
                mask=_hidden(kpos[None, :], _row_positions(p0, npos, rows, group)[:, None], window),
                out_rows=torch.arange(t0 * group, (t0 + npos) * group),
            )
        )
    num_tiles = max(u.num_tiles for u in big_units)
    blocks = [
        b for t in range(num_tiles) for b in _tile_blocks(tables[i], length, t, page_size, ppt)
    ]
    return BigSeq(
        blocks=torch.tensor(blocks, dtype=torch.long), context_len=length, units=big_units
    )
