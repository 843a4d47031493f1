"""The small integer arguments of a turn's device steps, as named fields of one packed int32 row.

A step's scalars (a slot, a start position, a key, a block-table row) travel as one int32
buffer of shape ``[1, N]``: on a GPU a small model's turn start is mostly dispatches, and
each host array an argument costs a host-to-device copy of its own (a prefill chunk took
1.49 ms with its arguments on the device against 1.87 ms with five host arrays; a turn's
setup cost 0.17-0.25 ms per call, mostly those copies). The classes here give the row's
columns names. The host builds one with numpy and `pack`s it; the jitted step `unpack`s it
by static slices (a field's offset follows from the field order and the static widths), so
no layout is read at magic offsets and no call retraces.

A field is one column unless a span width is given for it: one column unpacks as a ``[1]``
vector, a span of ``w`` columns as ``[1, w]``. Rows concatenate (`pack_rows`): a prefill
chunk's row may carry a drafter append after its own fields, which `ChunkMeta.unpack` hands
back as the rest of the row.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from flax import struct

from mtp.turn_start import DrafterRows

# On the host an int or a numpy array; in a step a [1] (one column) or [1, w] (a span) int32 slice.
Column = Any


class _PackedRow:
    """Packing and static unpacking for a dataclass of int32 columns, in field order."""

    @classmethod
    def _widths(cls, spans: dict[str, int]) -> dict[str, int]:
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = set(spans) - set(names)
        if unknown:
            raise ValueError(f"{cls.__name__} has no field {sorted(unknown)}")
        return {name: spans.get(name, 1) for name in names}

    @classmethod
    def size(cls, **spans: int) -> int:
        """Columns of the row, given each span field's width."""
        return sum(cls._widths(spans).values())

    def pack(self) -> np.ndarray:
        """The ``[1, N]`` int32 row: every field's values, flattened, in field order."""
        return np.concatenate([np.asarray(getattr(self, f.name), np.int32).reshape(-1)
                               for f in dataclasses.fields(self)])[None]

    @classmethod
    def unpack(cls, row, **spans: int):
        """The fields at the head of ``row`` (static slices; ``spans`` gives each span field's
        width) and the rest of the row."""
        fields, off = {}, 0
        for name, width in cls._widths(spans).items():
            fields[name] = row[:, off: off + width] if name in spans else row[:, off]
            off += width
        return cls(**fields), row[:, off:]


def pack_rows(*metas: _PackedRow) -> np.ndarray:
    """One buffer holding ``metas`` in order: one host-to-device copy for a fused call."""
    return np.concatenate([m.pack() for m in metas], axis=1)


@struct.dataclass
class ChunkMeta(_PackedRow):
    """One aligned target-prefill chunk of one batch slot (`steps.prefill_slot`)."""

    tokens: Column  # span: the chunk's tokens, zero past ``count``
    slot: Column  # the batch slot
    start: Column  # position of the chunk's first token
    count: Column  # tokens in the chunk
    write_from: Column  # first position whose KV is written: below it the prefix cache's pages are only read
    turn: Column  # the turn's generation: its first token's sampling key depends on it alone

    @classmethod
    def of(cls, slot: int, tokens, start: int, width: int, write_from: int, turn: int) -> "ChunkMeta":
        """``tokens`` padded to the compiled chunk ``width``."""
        padded = np.zeros((width,), np.int32)
        padded[: len(tokens)] = tokens
        return cls(tokens=padded, slot=slot, start=start, count=len(tokens), write_from=write_from, turn=turn)


@struct.dataclass
class DrafterAppend(_PackedRow):
    """One `mtp_head.append_rows` call on one slot: rows for pair keys ``first_key ..
    first_key + count - 1``, key ``k`` pairing ``tokens[k - first_key] = prompt[k + 1]`` with
    the captured hidden at ``k``."""

    tokens: Column  # span: the call's width (an `APPEND_BUCKETS` width), zero past ``count``
    first_key: Column
    count: Column

    @classmethod
    def read(cls, row) -> DrafterRows:
        """The rows a whole row holds, as `turn_start.append_from_hiddens` takes them: its span
        is what the two counts leave."""
        append, _ = cls.unpack(row, tokens=row.shape[1] - 2)
        return DrafterRows(tokens=append.tokens, first_key=append.first_key, count=append.count)


@struct.dataclass
class TurnSetup(_PackedRow):
    """A turn's slot state (`steps.begin_turn`): its block tables and its drafter's resident rows."""

    slot: Column
    drafter_rows: Column  # rows installed before any append (an adopted carry's, or 0)
    last_pair_key: Column  # the newest of them (-1: none)
    target_table: Column  # span: the slot's target block-table row
    drafter_table: Column  # span: the slot's drafter block-table row

    @classmethod
    def read(cls, row, table_width: int) -> "TurnSetup":
        setup, _ = cls.unpack(row, target_table=table_width, drafter_table=table_width)
        return setup


@struct.dataclass
class PageCopy(_PackedRow):
    """One KV page copied into another (`steps.copy_page`): a turn end's shared partial page,
    extended in the copy so that the entry holding it is never written."""

    src: Column
    dst: Column


__all__ = ["ChunkMeta", "Column", "DrafterAppend", "PageCopy", "TurnSetup", "pack_rows"]
