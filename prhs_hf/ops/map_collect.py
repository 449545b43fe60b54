"""What the mark-and-collect passes share: the marked positions of a zeroed map row, collected in order.

A pass marks the entries of each row of its output in its row of a zeroed map over the row's
index range (a position's mark is nonzero once any entry marks it), then collects every map row's
marked positions in ascending order, each with its mark, no sort. The parallel collect runs a
program per (row, chunk of :data:`MAP_CHUNK` map positions) twice: one launch counts each chunk's
marked positions (:func:`_chunk_count`), the next writes them from the counts of the row's chunks
before it (:func:`_chunks_before`, :func:`_marked_slots`) and pads its share of the row's output
(:func:`_pad_from`; :func:`chunk_grid` sizes the grid and the shares).

Two passes use them: the dilated sets of ``dilated_set.py`` (int8 marks: a selected index or
only a neighbour) and the KV-group unions of ``group_union.py`` (int32 marks: the bits of the query
heads whose sets hold the index). Each keeps its own kernels (named for the profiler) built from
these helpers.
"""

from __future__ import annotations

from typing import NamedTuple

from .triton_support import next_pow2, tl, triton

__all__ = ["MAP_CHUNK", "ChunkGrid", "chunk_grid"]

#: map positions per program of the parallel collect
MAP_CHUNK = 2048


class ChunkGrid(NamedTuple):
    """The parallel collect's layout of a map row and its output row."""

    chunk: int  # map positions per program
    n_chunks: int  # programs per row (the grid's second axis)
    share: int  # output slots each program pads: program c pads [c * share, (c + 1) * share)
    n_chunks_pow2: int  # n_chunks rounded up to a power of two (the block that loads a row's counts)


def chunk_grid(positions: int, out_slots: int, chunk: int) -> ChunkGrid:
    """The :class:`ChunkGrid` of map rows of ``positions`` (>= 1) collected into output rows of
    ``out_slots`` entries, ``chunk`` positions per program."""
    n_chunks = triton.cdiv(positions, chunk)
    return ChunkGrid(chunk, n_chunks, triton.cdiv(out_slots, n_chunks), next_pow2(n_chunks))


@triton.jit
def _chunk_marks(row, j, L):
    """The marks of map row ``row`` at positions ``j`` (0 at and after ``L``): ``(mark, marked)`` int32."""
    mark = tl.load(row + j, mask=j < L, other=0).to(tl.int32)
    return mark, (mark != 0).to(tl.int32)


@triton.jit
def _chunk_count(row, c, L, CHUNK: tl.constexpr):
    """How many positions of chunk ``c`` (``CHUNK`` positions) of map row ``row`` are marked."""
    _, marked = _chunk_marks(row, c * CHUNK + tl.arange(0, CHUNK), L)
    return tl.sum(marked, axis=0)


@triton.jit
def _chunks_before(COUNTS, pid, c, N_CHUNKS, NCH: tl.constexpr):
    """``(before, total)``: the marked positions of row ``pid``'s chunks before chunk ``c`` and of
    the whole row, from its chunk counts ``COUNTS[pid, :N_CHUNKS]`` (``NCH``: a power of two >= N_CHUNKS)."""
    ci = tl.arange(0, NCH)
    counts = tl.load(COUNTS + pid.to(tl.int64) * N_CHUNKS + ci, mask=ci < N_CHUNKS, other=0)
    return tl.sum(tl.where(ci < c, counts, 0), axis=0), tl.sum(counts, axis=0)


@triton.jit
def _marked_slots(row, j, n, L, NSET):
    """Where the marked positions ``j`` of map row ``row`` go in an output row of ``NSET`` slots, in
    order from slot ``n``: ``(mark, slot, store, marked)``, ``store`` false for an unmarked position
    and a slot at or past ``NSET``; ``marked`` counts the marked positions."""
    mark, marked = _chunk_marks(row, j, L)
    slot = n + tl.cumsum(marked, axis=0) - marked
    return mark, slot, (marked != 0) & (slot < NSET), tl.sum(marked, axis=0)


@triton.jit
def _pad_from(out, lo, hi, n, VALUE: tl.constexpr, BLOCK: tl.constexpr):
    """``VALUE`` (int32) at the slots ``[lo, hi)`` of ``out`` from slot ``n`` on (``n``: the row's size)."""
    for start in range(lo, hi, BLOCK):
        i = start + tl.arange(0, BLOCK)
        tl.store(out + i, tl.full([BLOCK], VALUE, tl.int32), mask=(i >= n) & (i < hi))
