"""This logical core's share of a kernel's static work under LNC = 1 or 2 (one job: the split, nothing else).

At LNC = 2 (``kernel[2]``, the trn2 default) the same kernel body runs on two physical NeuronCores that share
HBM; ``nl.program_id(0)`` says which one is tracing (0 or 1) and ``nl.num_programs(0)`` how many there are.
A kernel splits a static extent (rows, row tiles, output column slabs) so that each core writes a disjoint part
of its shared-HBM outputs; every element is then computed by the same instructions as at LNC = 1, and the
result is bitwise the single-core result.

The split: the extent is cut into ``⌈extent / tile⌉`` whole tiles (the last one may be short); core 0 takes the
first ``⌈tiles / 2⌉`` and core 1 the rest, so with one tile, or an odd count, core 1 has less — possibly nothing —
to do. Whole tiles keep each tile's instruction sequence (its shapes, its engines) what one core would run.

Public sources:
- NKI docs, "Using Logical NeuronCores (LNC) with NKI" (``nki/get-started/about/lnc``): ``kernel[2]`` launches
  on two cores with shared HBM, ``nl.num_programs`` tells whether the kernel runs on several cores and
  ``nl.program_id`` which one; LANG ``nki.language.program_id`` / ``num_programs`` pages.
- nki-library ``core/utils/kernel_helpers.py`` (``get_program_sharding_info``: the program count and id along
  axis 0, 1 and 0 without a grid) and ``core/mlp/mlp_cte/mlp_cte_sharding.py`` (a dimension cut into
  ``program_id``-indexed offsets); ``core/subkernels/indexed_flatten.py`` gives core 0 ``⌈E / 2⌉`` rows and
  core 1 ``⌊E / 2⌋`` at LNC = 2, the uneven split used here.
"""

from __future__ import annotations

from static_moe.nki.shim import nl


def programs_and_rank(kernel: str) -> tuple[int, int]:
    """``(programs, rank)``: the logical cores ``kernel`` runs on (1 or 2, asserted) and this core's id."""
    programs, rank = nl.num_programs(0), nl.program_id(0)
    assert programs in (1, 2), f"{kernel} runs on 1 or 2 logical cores (LNC), got {programs}"
    return programs, rank


def split(extent: int, tile: int, programs: int, rank: int) -> tuple[int, int]:
    """``(start, count)`` of core ``rank``'s part of ``[0, extent)``, in elements, cut at multiples of ``tile``.

    LNC = 1: ``(0, extent)``. LNC = 2: core 0 the first ``⌈T / 2⌉`` of the ``T = ⌈extent / tile⌉`` tiles,
    core 1 the others (``count`` 0 when T = 1). The two parts are disjoint and cover the extent.
    """
    assert extent >= 0 and tile >= 1 and 0 <= rank < programs, f"split: {extent=}, {tile=}, {programs=}, {rank=}"
    tiles = -(-extent // tile)
    first = -(-tiles // programs)  # the tiles of core 0
    lo, hi = (0, first) if rank == 0 else (first, tiles)
    start = min(extent, lo * tile)
    return start, min(extent, hi * tile) - start


def core_share(extent: int, tile: int, kernel: str) -> tuple[int, int]:
    """:func:`split` for the core tracing ``kernel`` (``nl.program_id(0)`` of ``nl.num_programs(0)``)."""
    return split(extent, tile, *programs_and_rank(kernel))


def core_tiles(extent: int, tile: int, kernel: str) -> range:
    """The first element of each of this core's tiles: ``range(start, start + count, tile)`` of :func:`core_share`."""
    start, count = core_share(extent, tile, kernel)
    return range(start, start + count, tile)
