"""The results table of docs/benchmarks.md, rendered from the per-host summaries (bench/results/hosts/*.json).

The table sits between two marker lines, ``<!-- results:begin -->`` and ``<!-- results:end -->``; `make bench`
replaces what is between them and leaves every other byte of the file as it was. One row per host file, sorted by
host id; a figure a host's run did not measure shows as "—".
"""

from __future__ import annotations

import json
from pathlib import Path

from .hosts import HOSTS_DIR, REPO

DOC = REPO / "docs" / "benchmarks.md"
BEGIN = "<!-- results:begin -->"
END = "<!-- results:end -->"

COLUMNS = (
    "host",
    "CPU",
    "threads",
    "read GB/s",
    "bf16 matmul GFLOP/s",
    "fp4 expert_gemm ×torch_int4pack, T = 1 / 4 / 16 / 64",
    "T = 1 ceiling t_int4pack / t_stream",
    "opt-in amx ×torch_int4pack, T = 16 / 64",
    "one row vs a plain read",
    "16+ rows vs bf16 matmul",
    "forward S = 2: experts in step vs alone",
    "quantize_weight fp8 / fp4 vs a copy",
    "commit",
)


def _span(r, fmt: str) -> str:
    if not r:
        return "—"
    lo, hi = (fmt.format(v) for v in r)
    return lo if lo == hi else f"{lo}–{hi}"


def _ratio(r) -> str:
    return _span(r, "{:.2f}")


def _percent(r) -> str:
    s = _span(r and [100 * v for v in r], "{:.0f}")
    return s if s == "—" else s + " %"


def _per_tokens(d: dict | None, tokens: tuple[str, ...]) -> str:
    d = d or {}
    return " / ".join(_ratio(d.get(t)) for t in tokens)


def host_row(doc: dict) -> list[str]:
    """One table row from one host summary (hosts.host_summary's layout)."""
    host, machine, s = doc.get("host", {}), doc.get("machine", {}), doc.get("summary", {})
    gb = machine.get("read_bandwidth")
    gf = machine.get("bf16_flops")
    return [
        f"`{host.get('id', '?')}`",
        host.get("cpu") or "—",
        str(host.get("threads", "—")),
        f"{gb / 1e9:.1f}" if gb else "—",
        f"{gf / 1e9:.0f}" if gf else "—",
        _per_tokens(s.get("int4pack"), ("1", "4", "16", "64")),
        _ratio(s.get("read_ceiling")),
        _per_tokens(s.get("amx_int4pack"), ("16", "64")) if any((s.get("amx_int4pack") or {}).values()) else "—",
        _percent(s.get("one_row_read")),
        _percent(s.get("bf16_matmul")),
        _ratio(s.get("forward_in_step")),
        " / ".join(_percent((s.get("quantize_copy") or {}).get(f)) for f in ("fp8", "fp4")),
        f"`{doc['run']['commit']}`" if (doc.get("run") or {}).get("commit") else "—",
    ]


def render_results_table(paths: list[Path]) -> str:
    """The markdown table of the host summaries at ``paths``, one row per file, sorted by host id; a line saying
    none is committed when ``paths`` is empty."""
    docs = sorted((json.loads(Path(p).read_text()) for p in paths), key=lambda d: d.get("host", {}).get("id", ""))
    if not docs:
        return "No host has a committed summary yet: the next `make bench` writes one and fills this table."
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join(host_row(d)) + " |" for d in docs]
    return "\n".join(lines)


def replace_between_markers(text: str, block: str) -> str:
    """``text`` with the lines between its BEGIN and END marker lines replaced by ``block``; the markers and
    everything outside them unchanged. A missing, repeated or misordered marker is a ValueError."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"expected one {BEGIN} line followed by one {END} line")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{block}\n{END}{tail}"


def host_files(hosts_dir: Path = HOSTS_DIR) -> list[Path]:
    return sorted(Path(hosts_dir).glob("*.json"))


def update_results_doc(doc: Path = DOC, hosts_dir: Path = HOSTS_DIR) -> Path:
    """Rewrite ``doc``'s results table from every summary in ``hosts_dir``."""
    doc = Path(doc)
    doc.write_text(replace_between_markers(doc.read_text(), render_results_table(host_files(hosts_dir))))
    return doc
