"""Which host a run measured, and the summary of that run `make bench` keeps per host kind.

A host kind is named by a stable, filesystem-safe id built from /proc/cpuinfo: vendor, family, model and the best
instruction set the CPU kernels can use there (csrc/cpu/simd.h), e.g. ``intel-6-207-amx`` or
``amd-25-17-avx512bf16``. The same VM type with AMX hidden is another kind (``intel-6-207-avx512bf16``): its
kernels, and so its figures, differ.

The summary (``bench/results/hosts/<host-id>.json``, committed) holds the host's description, the machine limits the
run measured, the target lines run_all printed and, per column of docs/benchmarks.md's results table, the range of
the figure over the target shapes. ``bench/results/bench.json`` (scratch, not committed) keeps every point.
"""

from __future__ import annotations

import json
import platform
import re
import subprocess
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HOSTS_DIR = REPO / "bench" / "results" / "hosts"

VENDORS = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}
# The CPU kernels' levels, best first, with the /proc/cpuinfo flags each needs (csrc/cpu/simd.h). The amx level
# also needs Linux's grant of the tile state, which the flags do not show; the id names the CPU, not the grant.
_AVX512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl"}
_AVX512BF16 = _AVX512 | {"avx512_bf16", "avx512vbmi"}
ISA_LEVELS = (
    ("amx", _AVX512BF16 | {"amx_tile", "amx_bf16"}),
    ("avx512bf16", _AVX512BF16),
    ("avx512", _AVX512),
    ("avx2", {"avx2", "fma", "f16c"}),
)


def cpu_fields(cpuinfo: str) -> dict[str, str]:
    """The first processor's ``key: value`` lines of a /proc/cpuinfo text."""
    out: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if out:
                break
            continue
        key, sep, value = line.partition(":")
        if sep:
            out.setdefault(key.strip(), value.strip())
    return out


def isa_level(flags: set[str]) -> str:
    """The best level of the CPU kernels these flags allow (``scalar`` when none)."""
    return next((name for name, need in ISA_LEVELS if need <= flags), "scalar")


def host_id(cpuinfo: str) -> str:
    """``<vendor>-<family>-<model>-<isa level>`` from a /proc/cpuinfo text, lower case, ``[a-z0-9-]`` only; CPUs
    without x86 family/model fields fall back to the architecture and what identifies the part."""
    f = cpu_fields(cpuinfo)
    if "cpu family" in f:
        parts = [
            VENDORS.get(f.get("vendor_id", ""), f.get("vendor_id", "x86")),
            f["cpu family"],
            f.get("model", "?"),
            isa_level(set(f.get("flags", "").split())),
        ]
    else:  # e.g. aarch64: implementer and part number
        parts = [platform.machine() or "cpu", f.get("CPU implementer", ""), f.get("CPU part", "")]
    return "-".join(p for p in (re.sub(r"[^a-z0-9]+", "", str(p).lower()) for p in parts) if p)


def this_host() -> dict:
    """The host this process runs on: its id and description (from /proc/cpuinfo; empty fields where unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    f = cpu_fields(text)
    flags = set(f.get("flags", "").split())
    return {
        "id": host_id(text) or (platform.machine() or "unknown"),
        "cpu": f.get("model name") or platform.processor(),
        "vendor": f.get("vendor_id", ""),
        "family": f.get("cpu family", ""),
        "model": f.get("model", ""),
        "isa": isa_level(flags) if flags else "",
        "machine": platform.machine(),
    }


def _commit() -> str | None:
    """The checked-out commit, ``+`` when the tree has changes (None outside a git checkout)."""
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+" if dirty else "")


def host_summary(report, host: dict, targets: dict[str, list[dict]], ranges: dict) -> dict:
    """The JSON `make bench` keeps for ``host``: its description, the run (threads, torch, commit, duration), the
    machine limits measured (best of start and end), the target lines as printed, and per column of the results
    table the range of its figure (``ranges``, run_all.summary_ranges)."""
    meta = report.meta
    return {
        "host": {**host, "threads": report.limits.threads},
        "run": {
            "torch": meta.get("torch"),
            "python": meta.get("python"),
            "commit": _commit(),
            "cpu_capability": meta.get("cpu_capability"),
            "elapsed_s": sum((meta.get("elapsed_s") or {}).values()),
        },
        "machine": asdict(report.limits),
        "targets": targets,
        "summary": ranges,
    }


def write_host_json(summary: dict, hosts_dir: Path = HOSTS_DIR) -> Path:
    """``<hosts_dir>/<host id>.json`` (replacing the previous run's on this host kind)."""
    hosts_dir.mkdir(parents=True, exist_ok=True)
    path = hosts_dir / f"{summary['host']['id']}.json"
    path.write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    return path
