"""Running a kernel through the interpreter: ``simulate(kernel)(*args)`` and ``jit``.

Arguments: numpy arrays (any NKI dtype, ml_dtypes for bf16/fp8) or torch tensors become HBM tensors (copies);
Python scalars, tuples of those, and other constants pass through. Lists are rejected (NKI 0.3 kernels take
tuples). The kernel runs eagerly in program order; HBM arguments it wrote are copied back into the caller's
arrays/tensors (as the NKI simulator does); returned tensors must live in ``nl.shared_hbm`` and come back as
numpy arrays (torch tensors if any argument was a torch tensor). Torch tensors on a device other than the CPU
(the test ``neuron`` device of tools/neuron_test_device.py) are read through ``.cpu()`` and written back with
``copy_``, and the results come back on the first tensor argument's device, as ``nki.jit`` returns device
tensors for device arguments.

After a run, :func:`last_run` gives its :class:`~.cost.CostRecord` and memory peaks.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field

import numpy as np

from . import dtypes as dt
from .cost import CostRecord
from .errors import NkiRuleError, check
from .state import run_context
from .tensor import NkiTensor, from_numpy, shared_hbm


@dataclass
class RunInfo:
    cost: CostRecord
    sbuf_peak_bytes: int  # per partition
    psum_peak_banks: int
    target: str
    programs: list = field(default_factory=list)  # LNC = 2: the CostRecord of each logical core
    runtime_loop_depth: int = 0  # deepest nesting of runtime loops (fori_loop / while_loop) in the run


_last: list[RunInfo] = []


def last_run() -> RunInfo:
    """Cost record and memory peaks of the most recent ``simulate`` call."""
    check(bool(_last), "no-run", "no kernel has been run yet")
    return _last[-1]


# ------------------------------------------------------------------------------------------ torch bridges
def _torch():
    try:
        import torch

        return torch
    except ImportError:  # pragma: no cover
        return None


def _torch_to_numpy(t) -> np.ndarray:
    torch = _torch()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.detach().cpu().contiguous()
    m = {
        torch.bfloat16: dt.bfloat16,
        torch.float8_e4m3fn: dt.float8_e4m3fn,
        torch.float8_e5m2: dt.float8_e5m2,
    }
    if hasattr(torch, "float8_e8m0fnu"):
        m[torch.float8_e8m0fnu] = dt.float8_e8m0fnu
    if t.dtype in m:
        u = {1: torch.uint8, 2: torch.int16}[t.element_size()]
        return t.view(u).numpy().view(m[t.dtype])
    if t.dtype == torch.bool:
        return t.to(torch.uint8).numpy()
    if t.dtype == torch.int64:
        raise NkiRuleError("dtype-unsupported", "int64 tensors are not an NKI dtype; pass int32")
    return t.numpy()


def _numpy_to_torch(a: np.ndarray):
    torch = _torch()
    m = {dt.bfloat16: torch.bfloat16, dt.float8_e4m3fn: torch.float8_e4m3fn, dt.float8_e5m2: torch.float8_e5m2}
    if a.dtype in m:
        u = {1: np.uint8, 2: np.int16}[a.dtype.itemsize]
        return torch.from_numpy(np.ascontiguousarray(a).view(u).copy()).view(m[a.dtype])
    if a.dtype == dt.float8_e4m3:
        raise NkiRuleError(
            "dtype-unsupported", "torch has no float8_e4m3 (trn2) dtype; return float32/bf16 or view the bytes as uint8"
        )
    return torch.from_numpy(np.ascontiguousarray(a).copy())


def _is_torch(x) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


# ------------------------------------------------------------------------------------------------ running
def _run_lnc2(fn, hargs, hkw, spec):
    """Run ``fn`` as two logical cores (threads) over the same HBM arguments; returns (core 0's result, the
    two run contexts). An error on either core is raised here; the other core's waits are released."""
    from .isa_lnc import LncGroup

    group = LncGroup(2)
    outs, errors, ctxs = [None, None], [None, None], [None, None]

    def core(rank):
        try:
            with run_context(spec, program=rank, programs=2, lnc=group) as c:
                ctxs[rank] = c
                outs[rank] = fn(*hargs, **hkw)
        except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
            errors[rank] = e
            group.barrier.abort()

    threads = [threading.Thread(target=core, args=(r,), name=f"nki-lnc-core{r}", daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(group.timeout_s * 4)
    check(not any(t.is_alive() for t in threads), "lnc-deadlock", "an LNC core did not finish")
    real = [e for e in errors if e is not None and getattr(e, "rule", "") != "lnc-deadlock"]
    if real or any(errors):
        raise (real or [e for e in errors if e is not None])[0]
    group.check_races(max(group.segment))  # the stretch after the last barrier
    return outs[0], ctxs


def simulate(kernel):
    """Return a callable that runs ``kernel`` through the interpreter on numpy arrays or torch tensors.
    ``simulate(k[2])`` runs it as two logical cores (LNC = 2), like the NKI simulator."""
    lnc = getattr(kernel, "lnc", 1)
    fn = getattr(kernel, "fn", kernel)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with run_context() as ctx:
            any_torch = False
            device = None  # the first torch argument's device: where torch results go
            bound = []  # (caller object, hbm tensor)

            def convert(x, where):
                nonlocal any_torch, device
                if isinstance(x, list):
                    raise NkiRuleError("kernel-args", f"{where} is a list; NKI kernels take tuples")
                if isinstance(x, tuple):
                    return tuple(convert(v, f"{where}[{i}]") for i, v in enumerate(x))
                if _is_torch(x):
                    any_torch = True
                    device = x.device if device is None else device
                    h = from_numpy(_torch_to_numpy(x), name=where)
                    bound.append((x, h))
                    return h
                if isinstance(x, np.ndarray):
                    h = from_numpy(x, name=where)
                    bound.append((x, h))
                    return h
                return x

            hargs = [convert(a, f"arg{i}") for i, a in enumerate(args)]
            hkw = {k: convert(v, k) for k, v in kwargs.items()}
            if lnc == 1:
                out, ctxs = fn(*hargs, **hkw), [ctx]
            else:
                out, ctxs = _run_lnc2(fn, hargs, hkw, ctx.spec)
            # copy HBM arguments the kernel wrote back into the caller's arrays
            for obj, h in bound:
                new = np.array(h._np()).reshape(np.shape(obj) if not _is_torch(obj) else tuple(obj.shape))
                if _is_torch(obj):
                    if obj.dtype == _torch().bool:
                        obj.copy_(_numpy_to_torch(new) != 0)
                    else:
                        obj.copy_(_numpy_to_torch(new).reshape(obj.shape))
                else:
                    obj[...] = new

            def back(o):
                # several outputs come back as a tuple or a list of shared_hbm tensors (public kernels return
                # both; the language guide's "return a, b" is a tuple)
                if isinstance(o, (tuple, list)):
                    return type(o)(back(v) for v in o)
                if isinstance(o, NkiTensor):
                    check(
                        o.buffer is shared_hbm and o.gather is None,
                        "output-buffer",
                        f"returned tensor {o.name or ''} is in {o.buffer.name}; kernel outputs must be allocated "
                        f"in nl.shared_hbm (NKI >= 0.3)",
                    )
                    a = np.array(o._np())
                    if not any_torch:
                        return a
                    t = _numpy_to_torch(a)
                    return t if device.type == "cpu" else t.to(device)
                check(o is None, "output-buffer", f"kernels return shared_hbm tensors, got {type(o).__name__}")
                return o

            result = back(out)
            c0 = ctxs[0]
            _last.append(
                RunInfo(
                    c0.cost,
                    c0.memory.sbuf_peak,
                    c0.memory.psum_banks_peak,
                    c0.spec.name,
                    programs=[c.cost for c in ctxs],
                    runtime_loop_depth=max(c.runtime_loop_depth_max for c in ctxs),
                )
            )
            del _last[:-1]
        return result

    return run


class Kernel:
    """What ``jit`` returns: calling it runs the kernel through the interpreter (as ``NKI_SIMULATOR=1`` does
    for the real ``nki.jit``). ``kernel[2]`` is the LNC = 2 launch (two logical cores sharing HBM, each with
    its own SBUF / PSUM; NeuronCore-v3+); ``kernel[1]`` is the default."""

    def __init__(self, fn, lnc: int = 1):
        self.fn, self.lnc = fn, lnc
        self._run = simulate(self)
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        return self._run(*args, **kwargs)

    def __getitem__(self, lnc):
        check(lnc in (1, 2), "lnc", f"LNC={lnc!r}: a logical NeuronCore groups 1 or 2 physical cores")
        return self if lnc == self.lnc else Kernel(self.fn, lnc)


def jit(fn=None, **kwargs):
    if fn is None:
        return lambda f: Kernel(f)
    return Kernel(fn)


def profile(kernel, *args, model=None, ideal_hbm_bytes: int | None = None, **kwargs) -> tuple:
    """Run ``kernel`` through the interpreter and estimate its time on the run's target (``cost.model_for``).

    Returns ``(result, report)``; report has the cost summary, the model's estimate (``time_s``, per-engine
    and DMA times, ``bound``), the HBM roofline of the bytes the kernel moved (``hbm_roofline_s``) and, when
    ``ideal_hbm_bytes`` is given (the bytes the op must move at least), ``ideal_s`` and
    ``roofline_fraction = ideal_s / time_s``. Reusable by any kernel's benchmark.

    LNC = 2 (``profile(kernel[2], ...)``): the counts of the summary (DMAs, HBM bytes, instructions) are the whole
    launch's, both cores' records merged, and ``hbm_roofline_s`` moves those bytes at both cores' HBM share;
    ``sbuf_peak_bytes`` / ``psum_peak_banks`` stay core 0's (they are per core).
    """
    from .cost import model_for

    result = simulate(kernel)(*args, **kwargs)
    info = last_run()
    model = model or model_for(info.target)
    est = model.estimate_programs(info.programs)  # LNC = 2 (kernel[2]): both cores, barrier by barrier
    launch = functools.reduce(lambda a, b: a.merged(b), info.programs) if len(info.programs) > 1 else info.cost
    report = {
        **launch.summary(),
        **est,
        "sbuf_peak_bytes": info.sbuf_peak_bytes,
        "psum_peak_banks": info.psum_peak_banks,
        "hbm_roofline_s": model.hbm_roofline(launch.hbm_bytes) / est["programs"],
        "target": info.target,
    }
    if ideal_hbm_bytes is not None:
        report["ideal_hbm_bytes"] = ideal_hbm_bytes
        report["ideal_s"] = model.hbm_roofline(ideal_hbm_bytes) / est["programs"]
        report["roofline_fraction"] = model.mbu(ideal_hbm_bytes, est["time_s"], est["programs"])
    return result, report
