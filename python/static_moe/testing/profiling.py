"""Helpers for reading torch.profiler output in the demo and the benchmarks."""

from __future__ import annotations

import contextlib
import os
import sys


@contextlib.contextmanager
def quiet_stderr():
    """Silence file descriptor 2 for the duration: torch.profiler's C++ side prints a line at every start and stop,
    which would interleave with the tables the demo and the benchmarks print."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
