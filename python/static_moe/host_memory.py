"""Host memory for the expert weights a layer owns: anonymous mappings advised for transparent huge pages.

A decode step streams every selected expert's weights from DRAM once, and on one core that stream runs at the rate
the hardware prefetchers sustain. They stop at every 4 KiB page boundary, and a 4 KiB page costs a TLB miss per
4 KiB of each weight row read; in 2 MiB pages a weight matrix is a few hundred pages. Linux gives a mapping 2 MiB
pages only where its ``transparent_hugepage`` mode is ``always``, or ``madvise`` and the mapping was advised with
``madvise(MADV_HUGEPAGE)`` before its pages are first touched (kernel docs, admin-guide/mm/transhuge). torch's
allocator advises only when ``THP_MEM_ALLOC_ENABLE=1`` is set for the whole process; here the layer advises its own
weights, whatever the process does. vLLM allocates its Engram tables the same way (``mmap.mmap`` anonymous,
``madvise(MADV_HUGEPAGE)``, ``torch.frombuffer``: ``vllm/models/deepseek_v41/common/engram.py``).

Where the mapping or the advice is not available (not Linux, a kernel built without THP), or the tensor is small
or not on the CPU, :func:`zeros` is ``torch.zeros``: the advice changes where bytes live, never their values.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE_BYTES = 2 << 20
# Smaller tensors stay with torch's allocator: a mapping is page-granular, and one that is not 2 MiB-aligned
# gets huge pages only for the whole 2 MiB extents inside it.
MIN_ADVISED_BYTES = 4 * HUGE_PAGE_BYTES


def _advised_mapping(nbytes: int) -> mmap.mmap | None:
    """A zero-filled private anonymous mapping of ``nbytes`` advised for huge pages, or None where it cannot be."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return None
    try:
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError):
        return None
    try:
        m.madvise(advice)
    except OSError:  # EINVAL: a kernel without transparent huge pages
        m.close()
        return None
    return m


def advice_available() -> bool:
    """Whether this host can advise a mapping for huge pages (Linux with transparent huge pages built in), i.e.
    whether :func:`zeros` gives large CPU tensors their own advised mapping."""
    m = _advised_mapping(MIN_ADVISED_BYTES)
    if m is None:
        return False
    m.close()
    return True


def zeros(shape, dtype: torch.dtype, device=None) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype, device=device)``; on the CPU, from ``MIN_ADVISED_BYTES`` up, in its own
    anonymous mapping advised for huge pages (module doc). The tensor owns the mapping (unmapped when the last
    tensor viewing it is freed); it is contiguous, writable and behaves as any CPU tensor (copies, views,
    ``torch.save``)."""
    where = torch.empty(0, device=device).device
    nbytes = math.prod(shape) * dtype.itemsize
    if where.type != "cpu" or nbytes < MIN_ADVISED_BYTES:
        return torch.zeros(shape, dtype=dtype, device=where)
    m = _advised_mapping(nbytes)
    if m is None:
        return torch.zeros(shape, dtype=dtype, device=where)
    # frombuffer holds a reference to the mapping for the tensor's lifetime (torch.frombuffer docs).
    return torch.frombuffer(m, dtype=torch.uint8).view(dtype).view(shape)


def is_advised(t: torch.Tensor) -> bool:
    """Whether the first byte of CPU tensor ``t`` lies in a mapping advised for huge pages (Linux
    ``/proc/self/smaps`` VmFlags ``hg``); False where that file does not exist."""
    addr = t.data_ptr()
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(v, 16) for v in head.split("-"))
                    inside = lo <= addr < hi
                elif inside and head == "VmFlags:":
                    return "hg" in line.split()[1:]
    except OSError:
        return False
    return False
