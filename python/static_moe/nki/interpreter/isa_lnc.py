"""LNC = 2 instructions (``sendrecv``, ``core_barrier``): NeuronCore-v3+ with two logical cores.

The interpreter runs one logical core (``kernel[2]`` is refused by :mod:`.runtime`), so a kernel reaching
these instructions is refused with ``not-modelled``; with one core there is no peer to exchange with, and a
silent no-op would hide a missing exchange.
"""

from __future__ import annotations

from .errors import NkiRuleError


def sendrecv(src, dst, send_to_rank, recv_from_rank, pipe_id, dma_engine=None, name=None):
    raise NkiRuleError("not-modelled", "nisa.sendrecv needs LNC=2, which the interpreter does not run")


def core_barrier(data, cores, engine=None, name=None):
    raise NkiRuleError("not-modelled", "nisa.core_barrier needs LNC=2, which the interpreter does not run")
