"""Run a function on S gloo ranks on localhost, with a hard deadline: a bug fails, it never hangs.

``run_ranks(fn, S, *args)`` spawns S processes; each initialises a gloo process group (a FileStore in a fresh
temporary directory, so no port is ever guessed), runs ``fn(rank, S, *args)`` and sends back its return value
or its exception. The caller gets the S return values in rank order, or :class:`RankFailure` with every
rank's traceback; past ``timeout`` seconds the processes are killed and :class:`RankFailure` says which ranks
had not finished. ``fn`` must be importable by a fresh interpreter (a module-level function).

Ranks run with one intra-op thread each (the machines here have two cores for everyone).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue as queue_mod
import tempfile
import time
import traceback


class RankFailure(AssertionError):
    """One or more ranks raised, or did not finish in time. ``errors`` maps rank → (exception type, traceback)."""

    def __init__(self, message: str, errors: dict[int, tuple[str, str]]):
        super().__init__(message)
        self.errors = errors


def _worker(fn, rank: int, size: int, store_path: str, pg_timeout: float, threads: int, args, results) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        try:
            value = fn(rank, size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", value))
    except BaseException as e:  # noqa: BLE001  (everything goes back to the parent)
        results.put((rank, type(e).__name__, traceback.format_exc()))


def run_ranks(fn, size: int, *args, timeout: float = 120.0, pg_timeout: float = 30.0, threads: int = 1) -> list:
    """``[fn(0, size, *args), …, fn(size − 1, size, *args)]``, each run on its own gloo rank.

    Args:
        timeout: seconds for the whole run, start-up included; then every rank is killed.
        pg_timeout: the process group's own timeout (a collective that waits longer fails on its rank).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="static_moe_dist_") as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(fn, r, size, store, pg_timeout, threads, args, results), daemon=True)
            for r in range(size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        got: dict[int, tuple[str, object]] = {}
        try:
            while len(got) < size:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    rank, status, value = results.get(timeout=min(left, 1.0))
                    got[rank] = (status, value)
                except queue_mod.Empty:
                    # A rank that died without reporting (segfault, OOM kill) counts as failed at once.
                    for r, p in enumerate(procs):
                        if r not in got and not p.is_alive() and p.exitcode not in (0, None):
                            got[r] = ("died", f"rank {r} exited with code {p.exitcode} without reporting")
        finally:
            for p in procs:
                p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
    missing = [r for r in range(size) if r not in got]
    errors = {r: got[r] for r in got if got[r][0] != "ok"}
    if missing or errors:
        parts = [f"ranks {missing} did not finish within {timeout:.0f} s"] if missing else []
        parts += [f"--- rank {r}: {kind}\n{tb}" for r, (kind, tb) in sorted(errors.items())]
        raise RankFailure("\n".join(parts), {r: (k, str(tb)) for r, (k, tb) in errors.items()})
    return [got[r][1] for r in range(size)]


def gather_objects(obj) -> list:
    """Inside a rank: every rank's ``obj`` (picklable), in rank order, over the default group."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def expect_raises(exc_type, fn, *needles: str) -> str:
    """Inside a rank: call ``fn``, require ``exc_type`` whose message contains every needle; return the message.

    Workers report results back to the parent as plain data, so they check errors with this instead of
    pytest.raises (whose failure would only surface as a dead worker)."""
    try:
        fn()
    except exc_type as e:
        for n in needles:
            assert n in str(e), f"{n!r} not in {e}"
        return str(e)
    raise AssertionError(f"{exc_type.__name__} not raised")
