"""Jagged arrays: ``values[T_cap, ...]`` + ``offsets[B_cap+1]`` with static capacities.

Built on the host in numpy by the data pipeline, then moved to a backend with
``B.asarray_tree``. An optional ``TilePlan`` (the jagged attention's chunk pairs) rides along with
its own ladder capacities. Derived index arrays (segment id and position per token, a padded-dense
index map, the last token of each sequence) are computed here once, so no op ever needs a
data-dependent shape: under ``jax.jit`` every batch of the same capacities reuses one program.

Conventions (those of the HSTU kernels; adapters translate to vendor conventions):
- ``offsets[0] == 0``, non-decreasing, ``offsets[B] == T`` (real tokens); slots ``b >= B`` are empty.
- Padding tokens ``t >= T`` belong to the dummy segment ``B_cap`` and are ignored by every op.
- ``dense_index[b, i]`` is the token index of position ``i`` of sequence ``b``, or ``T_cap`` for an
  empty cell (gathers read a zero row appended at ``T_cap``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from .tree import static_field
from .errors import JaggedError  # noqa: F401 (re-exported)

INDEX_DTYPE = np.int32
_INT32 = np.iinfo(np.int32)


def round_up_capacity(n: int, minimum: int = 8) -> int:
    """Smallest capacity in the ladder {2^k, 1.5*2^k} (>= minimum) that holds ``n``.

    A short ladder keeps the number of compiled JAX programs small (one per capacity) while
    wasting at most a third of the slots.
    """
    cap = minimum
    while True:
        if cap >= n:
            return cap
        if cap * 3 // 2 >= n and (cap * 3) % 2 == 0:
            return cap * 3 // 2
        cap *= 2


@dataclasses.dataclass(frozen=True)
class Jagged:
    """A batch of variable-length sequences without padding to ``max_len``.

    Fields (numpy on the host, backend arrays after ``B.asarray_tree``):
      values[T_cap, ...]         any dtype; rows ``>= T`` are padding (zeros)
      offsets[B_cap+1] int32     sequence b owns rows ``offsets[b]:offsets[b+1]``
      lengths[B_cap] int32       ``offsets[1:] - offsets[:-1]``
      seq_id[T_cap] int32        sequence of each row; padding rows -> ``B_cap``
      pos[T_cap] int32           position of each row inside its sequence; padding -> 0
      dense_index[B_cap, max_len] int32   row of (b, i), or ``T_cap`` for an empty cell
      last_index[B_cap] int32    row of the last token of b, or ``T_cap`` for an empty slot
      max_len: int (static)      longest allowed sequence; the padded-dense width
      tiles: TilePlan or None    the chunk/pair plan of the jagged attention kernels (optional)
    """

    values: Any
    offsets: Any
    lengths: Any
    seq_id: Any
    pos: Any
    dense_index: Any
    last_index: Any
    max_len: int = static_field()
    tiles: "TilePlan | None" = None

    def with_tiles(self, tile: int, p_cap: int | None = None, nc_cap: int | None = None) -> "Jagged":
        """This layout plus the ``TilePlan`` of block-sparse causal attention with ``tile``-token
        chunks (host only: built in numpy from ``offsets``)."""
        return dataclasses.replace(self, tiles=TilePlan.build(self, tile, p_cap=p_cap, nc_cap=nc_cap))

    @property
    def t_cap(self) -> int:
        return int(self.values.shape[0])

    @property
    def b_cap(self) -> int:
        return int(self.offsets.shape[0]) - 1

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_offsets(cls, values: np.ndarray, offsets: Sequence[int] | np.ndarray, *, max_len: int,
                     t_cap: int | None = None, b_cap: int | None = None) -> "Jagged":
        """Validate and build from packed ``values[T, ...]`` and ``offsets[B+1]``.

        ``t_cap``/``b_cap`` default to ``round_up_capacity`` of the real sizes. Raises
        ``JaggedError`` naming the first bad entry.
        """
        values = np.asarray(values)
        offsets = np.asarray(offsets)
        if offsets.ndim != 1 or offsets.shape[0] < 1:
            raise JaggedError(f"offsets must be 1-D with B+1 >= 1 entries, got shape {offsets.shape}")
        if not np.issubdtype(offsets.dtype, np.integer):
            raise JaggedError(f"offsets must be integers, got dtype {offsets.dtype}")
        if offsets[0] != 0:
            raise JaggedError(f"offsets[0] must be 0, got {offsets[0]}")
        steps = np.diff(offsets.astype(np.int64))
        if (steps < 0).any():
            b = int(np.argmax(steps < 0))
            raise JaggedError(f"offsets must be non-decreasing: offsets[{b}]={offsets[b]} > offsets[{b + 1}]={offsets[b + 1]}")
        if values.ndim < 1:
            raise JaggedError("values must have at least one axis (tokens)")
        total = int(offsets[-1])
        if total != values.shape[0]:
            raise JaggedError(f"offsets[-1]={total} but values has {values.shape[0]} rows")
        if steps.size and steps.max() > max_len:
            b = int(np.argmax(steps))
            raise JaggedError(f"sequence {b} has length {steps[b]} > max_len={max_len}; truncate it "
                              f"(keep the most recent max_len events) or raise max_len")
        _check_fits_int32(values, "values")
        n_seq = offsets.shape[0] - 1
        b_cap = round_up_capacity(n_seq, 1) if b_cap is None else b_cap
        t_cap = round_up_capacity(total) if t_cap is None else t_cap
        if b_cap < n_seq:
            raise JaggedError(f"b_cap={b_cap} < number of sequences {n_seq}")
        if t_cap < total:
            raise JaggedError(f"t_cap={t_cap} < number of tokens {total}")
        if t_cap >= _INT32.max:
            raise JaggedError(f"t_cap={t_cap} does not fit the int32 index dtype")

        offsets_cap = np.full(b_cap + 1, total, dtype=INDEX_DTYPE)
        offsets_cap[: n_seq + 1] = offsets
        lengths = np.diff(offsets_cap).astype(INDEX_DTYPE)
        seq_id = np.full(t_cap, b_cap, dtype=INDEX_DTYPE)
        seq_id[:total] = np.repeat(np.arange(b_cap, dtype=INDEX_DTYPE), lengths)
        pos = np.zeros(t_cap, dtype=INDEX_DTYPE)
        pos[:total] = np.arange(total, dtype=INDEX_DTYPE) - offsets_cap[seq_id[:total]]
        dense_index = np.full((b_cap, max_len), t_cap, dtype=INDEX_DTYPE)
        dense_index[seq_id[:total], pos[:total]] = np.arange(total, dtype=INDEX_DTYPE)
        last_index = np.where(lengths > 0, offsets_cap[1:] - 1, t_cap).astype(INDEX_DTYPE)
        padded = np.zeros((t_cap,) + values.shape[1:], dtype=_canonical_dtype(values.dtype))
        padded[:total] = values
        return cls(padded, offsets_cap, lengths, seq_id, pos, dense_index, last_index, int(max_len))

    @classmethod
    def from_sequences(cls, sequences: Sequence[np.ndarray], *, max_len: int, t_cap: int | None = None,
                       b_cap: int | None = None) -> "Jagged":
        """Build from a list of per-sequence arrays ``[L_b, ...]`` (each ``L_b <= max_len``)."""
        lengths = [len(s) for s in sequences]
        offsets = np.zeros(len(sequences) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if sequences:
            values = np.concatenate([np.asarray(s) for s in sequences], axis=0)
        else:
            values = np.zeros((0,), dtype=np.int32)
        return cls.from_offsets(values, offsets, max_len=max_len, t_cap=t_cap, b_cap=b_cap)

    # ------------------------------------------------------------------ host-side views
    def num_tokens(self) -> int:
        return int(np.asarray(self.offsets)[-1])

    def to_sequences(self) -> list[np.ndarray]:
        """Real sequences as numpy arrays (host only; drops empty slots at the end)."""
        values, offsets = np.asarray(self.values), np.asarray(self.offsets)
        return [values[offsets[b]:offsets[b + 1]] for b in range(self.b_cap)]

    def to_padded(self, fill=0) -> np.ndarray:
        """Padded dense ``[B_cap, max_len, ...]`` numpy copy (the oracle layout in tests)."""
        values = np.asarray(self.values)
        ext = np.concatenate([values, np.full((1,) + values.shape[1:], fill, values.dtype)], axis=0)
        return ext[np.asarray(self.dense_index)]


def tile_counts(lengths, tile: int) -> tuple[int, int]:
    """(chunks, pairs) of the tile plan of sequences with these lengths (capacity planning)."""
    n = -(-np.asarray(lengths, dtype=np.int64) // tile)
    return int(n.sum()), int((n * (n + 1) // 2).sum())


def tile_capacities(chunks: int, pairs: int) -> tuple[int, int]:
    """Ladder capacities ``(p_cap, nc_cap)`` (note the order: pairs first, as ``make_batch``'s
    arguments) that hold a plan of ``chunks`` chunks and ``pairs`` pairs (one padding pair is
    always kept, see ``TilePlan.build``)."""
    return round_up_capacity(pairs + 1), round_up_capacity(max(chunks, 1), 1)


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """Block-sparse plan of causal attention inside each sequence, without padding to max_len.

    Each sequence is cut into chunks of ``tile`` consecutive tokens (the last one partly empty); a
    query chunk attends to every earlier-or-equal chunk of its own sequence. One *pair* is one
    (query chunk, key chunk) tile of ``tile x tile`` scores, so the work and the memory of the
    attention grow with ``sum_b ceil(L_b / tile)^2 / 2`` tiles, not with ``B * max_len^2``.
    All shapes are static given (``nc_cap``, ``p_cap``), which come from the capacity ladder.

      chunk_rows[nc_cap+1, tile] int32  token row of each cell of chunk c (``T_cap`` if empty);
                                        the last chunk, ``nc_cap``, is the dummy (all empty)
      pair_q[P_cap] int32             query chunk of pair p, sorted; padding pairs -> ``nc_cap``
      pair_k[P_cap] int32             key chunk of pair p; padding pairs -> ``nc_cap``
      token_cell[T_cap] int32         ``chunk * tile + offset`` of each token; padding tokens point
                                      at the dummy chunk ``nc_cap`` (whose output is zero)
      tile: int (static)              chunk length
      nc_cap: int (static)            chunk capacity; chunk ``nc_cap`` is the dummy one
    """

    chunk_rows: Any
    pair_q: Any
    pair_k: Any
    token_cell: Any
    tile: int = static_field()
    nc_cap: int = static_field()

    @classmethod
    def build(cls, layout: "Jagged", tile: int, p_cap: int | None = None,
              nc_cap: int | None = None) -> "TilePlan":
        if tile < 1:
            raise JaggedError(f"attention tile must be >= 1, got {tile}")
        offsets = np.asarray(layout.offsets).astype(np.int64)
        lengths = np.diff(offsets)
        t_cap = layout.t_cap
        n_chunks = -(-lengths // tile)                       # ceil(L / tile) per sequence
        nc = int(n_chunks.sum())
        # chunk c: its sequence, index inside the sequence, first token row
        chunk_seq = np.repeat(np.arange(len(lengths)), n_chunks)
        first_chunk = np.concatenate([[0], np.cumsum(n_chunks)])
        chunk_in_seq = np.arange(nc) - first_chunk[chunk_seq]
        chunk_start = offsets[chunk_seq] + chunk_in_seq * tile
        chunk_end = np.minimum(chunk_start + tile, offsets[chunk_seq + 1])
        # pairs (q chunk c, k chunk c - d) for d = 0..chunk_in_seq[c]; sorted by q chunk
        n_pairs_per_q = chunk_in_seq + 1
        p = int(n_pairs_per_q.sum())
        pair_q = np.repeat(np.arange(nc), n_pairs_per_q)
        first_pair = np.concatenate([[0], np.cumsum(n_pairs_per_q)])
        pair_k = first_chunk[chunk_seq[pair_q]] + (np.arange(p) - first_pair[pair_q])
        # capacities: the dummy chunk nc_cap and at least one padding pair always exist
        ladder_p, ladder_nc = tile_capacities(nc, p)
        p_cap = ladder_p if p_cap is None else p_cap
        nc_cap = ladder_nc if nc_cap is None else nc_cap
        if nc_cap < nc or p_cap < p + 1:
            raise JaggedError(f"tile plan needs nc_cap >= {nc} and p_cap >= {p + 1}, "
                              f"got {nc_cap} and {p_cap}")
        cell = np.arange(tile)
        rows = chunk_start[:, None] + cell[None, :]
        rows = np.where(rows < chunk_end[:, None], rows, t_cap)                  # [nc, tile]
        chunk_rows = np.full((nc_cap + 1, tile), t_cap, dtype=np.int64)
        chunk_rows[:nc] = rows
        pq = np.full(p_cap, nc_cap, dtype=np.int64)
        pk = np.full(p_cap, nc_cap, dtype=np.int64)
        pq[:p], pk[:p] = pair_q, pair_k
        token_cell = np.full(t_cap, nc_cap * tile, dtype=np.int64)
        real = rows < t_cap
        token_cell[rows[real]] = (np.arange(nc)[:, None] * tile + cell[None, :])[real]
        if (nc_cap + 1) * tile >= _INT32.max:
            raise JaggedError(f"tile plan of {nc_cap} chunks x {tile} does not fit int32 indices")
        return cls(chunk_rows.astype(INDEX_DTYPE), pq.astype(INDEX_DTYPE), pk.astype(INDEX_DTYPE),
                   token_cell.astype(INDEX_DTYPE), int(tile), int(nc_cap))

    def num_pairs(self) -> int:
        """Real (non-padding) pairs (host only)."""
        return int((np.asarray(self.pair_q) < self.nc_cap).sum())


def _canonical_dtype(dtype):
    # int64 ids would be silently truncated by JAX (x64 off): store ids as int32 once checked.
    if np.issubdtype(dtype, np.integer):
        return np.int32
    return dtype


def _check_fits_int32(values: np.ndarray, name: str) -> None:
    if np.issubdtype(values.dtype, np.integer) and values.size:
        lo, hi = values.min(), values.max()
        if lo < _INT32.min or hi > _INT32.max:
            bad = hi if hi > _INT32.max else lo
            raise JaggedError(f"{name} holds {bad}, which does not fit the int32 index dtype (JAX would "
                              f"silently truncate it); remap ids to a dense range 1..N first "
                              f"(gr_functional.data remaps ids when loading)")
