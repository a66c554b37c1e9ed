"""The results of one run: records with speed-ups and roofline, the printed table, JSON and PNG plots."""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from static_moe.testing.generators import MODEL_SHAPES
from static_moe.testing.machine import MachineLimits

from .costs import Cost, roofline

BASELINES = ("seed_dense", "torch_cached", "torch_scaled_mm", "torch_int4pack", "torch_ref")


@dataclass
class Report:
    """Collects records of one run; prints the table, writes JSON and plots."""

    limits: MachineLimits
    meta: dict = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)

    def add(self, record: dict) -> dict:
        """Fill speed-ups (baseline median / op median) and keep the record."""
        op = record.get("op", {})
        t = op.get("median_s") if op.get("available", True) else None
        record["speedup"] = {
            name: (b["median_s"] / t if t and b.get("median_s") else None)
            for name, b in record.get("baselines", {}).items()
        }
        self.records.append(record)
        return record

    def refresh_limits(self, again: MachineLimits) -> None:
        """Keep the best of the run's measurements of the machine and recompute every record's roofline."""
        self.limits = self.limits.best(again)
        for r in self.records:
            op = r.get("op", {})
            t = op.get("median_s") if op.get("available", True) else None
            r.update(
                roofline(
                    Cost(r["bytes"], r["flops"], r.get("read_bytes", 0.0)),
                    self.limits,
                    t,
                    r.get("compute_peak") == "bf16",
                )
            )

    def header(self) -> str:
        m = self.limits
        cpu = f"{self.meta.get('cpu', '?')} ({self.meta.get('cpu_capability', '?')})  " if self.meta else ""
        return (
            f"{cpu}threads={m.threads}  bandwidth={m.bandwidth / 1e9:.1f} GB/s (triad, 3×{m.triad_array_bytes >> 20} "
            f"MiB arrays, LLC {m.llc_bytes >> 20} MiB)  read-only={m.read_bandwidth / 1e9:.1f} GB/s (sum over "
            f"{m.read_array_bytes >> 20} MiB: the weights' roof)  fp32 peak={m.flops / 1e9:.1f} GFLOP/s "
            f"(matmul n={m.matmul_n}; bf16 matmul {m.bf16_flops / 1e9:.0f} GFLOP/s: the roof where the kernel "
            f"uses bf16 dot products)"
        )

    def table(self, records: list[dict] | None = None) -> str:
        recs = self.records if records is None else records
        cols = [
            "bench",
            "shape",
            "fmt",
            "T",
            "rows/e",
            "experts",
            "median",
            "coll",
            "MB",
            "GFLOP",
            "t_mem",
            "t_flop",
            "bound",
            "roof%",
            "roof%bf16",
            "×seed",
            "×cached",
            "×scaled",
            "×int4",
            "×ref",
        ]
        rows = [cols]
        for r in recs:
            op = r.get("op", {})
            ok = op.get("available", True)
            sp = r.get("speedup", {})
            rows.append(
                [
                    r["bench"] + (f" S={r['ep_size']}" if "ep_size" in r else ""),
                    r.get("shape", ""),
                    r.get("fmt", ""),
                    str(r.get("tokens", "")),
                    _fmt_num(r.get("rows_per_expert"), "{:.1f}"),
                    r.get("experts", ""),
                    _fmt_time(op.get("median_s")) if ok else "n/a",
                    _fmt_time(r.get("collective_s")),
                    f"{r['bytes'] / 1e6:.2f}",
                    f"{r['flops'] / 1e9:.3f}" if r["flops"] else "—",
                    _fmt_time(r["t_mem_s"]),
                    _fmt_time(r["t_compute_s"]) if r["flops"] else "—",
                    r["bound"][:3],
                    _fmt_num(r.get("roofline_fraction") and 100 * r["roofline_fraction"], "{:.0f}%"),
                    _fmt_num(r.get("roofline_fraction_bf16_peak") and 100 * r["roofline_fraction_bf16_peak"], "{:.0f}%")
                    if r["flops"]
                    else "—",
                    *(_fmt_speedup(sp, r, name) for name in BASELINES),
                ]
            )
        widths = [max(len(str(row[i])) for row in rows) for i in range(len(cols))]
        lines = ["  ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in rows]
        lines.insert(1, "-" * len(lines[0]))
        return "\n".join(lines)

    def notes(self) -> str:
        """Baselines that could not run, and why (once each)."""
        seen = {}
        for r in self.records:
            for name, b in r.get("baselines", {}).items():
                if not b.get("available", True):
                    seen.setdefault(name, b.get("reason", ""))
            op = r.get("op", {})
            if not op.get("available", True):
                seen.setdefault(f"op {r['bench']}", op.get("reason", ""))
        return "\n".join(f"  {k}: unavailable — {v}" for k, v in seen.items())

    def write_json(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {"machine": asdict(self.limits), "meta": self.meta, "records": self.records}
        path.write_text(json.dumps(doc, indent=1, default=json_default))
        return path

    def plot(self, out_dir: Path, bench: str) -> list[Path]:
        """Two PNGs for one bench: roofline fraction and speed-ups, each against tokens per rank, one panel per
        shape (and per baseline for speed-ups), one line per format (and EP size)."""
        recs = [r for r in self.records if r["bench"] == bench and r.get("op", {}).get("available", True)]
        if not recs:
            return []
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, NullFormatter

        out_dir.mkdir(parents=True, exist_ok=True)
        shapes = list(dict.fromkeys(r["shape"] for r in recs))
        label = lambda r: r["fmt"] + (f" S={r['ep_size']}" if "ep_size" in r else "")  # noqa: E731
        series = lambda rs: _group(rs, label)  # noqa: E731
        colors = {lab: f"C{i}" for i, lab in enumerate(dict.fromkeys(label(r) for r in recs))}
        xticks = sorted({r["tokens"] for r in recs})
        plain = FuncFormatter(lambda v, _: f"{v:g}")

        def style(ax, log_y: bool) -> None:
            ax.set_xscale("log", base=2)
            ax.set_xticks(xticks)
            ax.xaxis.set_major_formatter(plain)
            ax.xaxis.set_minor_formatter(NullFormatter())
            if log_y:
                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(plain)
                lo, hi = ax.get_ylim()
                few = FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else "")  # wide ranges: 2s, 5s
                ax.yaxis.set_minor_formatter(plain if hi < 10 * lo else few)
            ax.grid(True, which="major", alpha=0.3)
            ax.legend(fontsize=7)

        paths = []

        fig, axes = plt.subplots(1, len(shapes), figsize=(max(6.0, 5 * len(shapes)), 4), squeeze=False)
        for ax, shape in zip(axes[0], shapes):
            for lab, rs in series([r for r in recs if r["shape"] == shape]).items():
                pts = [(r["tokens"], r["roofline_fraction"]) for r in rs if r.get("roofline_fraction")]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=lab, color=colors[lab])
            ax.set(
                xlabel="tokens per rank", ylabel="fraction of roofline", title=f"{bench} — {MODEL_SHAPES[shape].name}"
            )
            ax.axhline(1.0, color="grey", lw=0.5)
            style(ax, log_y=False)
            ax.set_ylim(0, max(1.05, ax.get_ylim()[1]))
        fig.suptitle(
            f"{bench}: roofline fraction (compute limit: the peak of the units the kernel uses; "
            f"{self.limits.threads} threads{self._on_host()})",
            fontsize=10,
        )
        fig.tight_layout()
        paths.append(out_dir / f"{bench}_roofline.png")
        fig.savefig(paths[-1], dpi=90)
        plt.close(fig)

        names = [n for n in BASELINES if any((r.get("speedup") or {}).get(n) for r in recs)]
        if names:
            fig, axes = plt.subplots(
                len(shapes), len(names), figsize=(max(6.0, 4.5 * len(names)), 3.5 * len(shapes)), squeeze=False
            )
            for i, shape in enumerate(shapes):
                for j, name in enumerate(names):
                    ax = axes[i][j]
                    for lab, rs in series([r for r in recs if r["shape"] == shape]).items():
                        pts = [(r["tokens"], r["speedup"][name]) for r in rs if r["speedup"].get(name)]
                        if pts:
                            ax.plot(*zip(*pts), marker="o", label=lab, color=colors[lab])
                    ax.axhline(1.0, color="grey", lw=0.5)
                    ax.set(xlabel="tokens per rank", ylabel=f"speed-up vs {name}", title=MODEL_SHAPES[shape].name)
                    style(ax, log_y=True)
            fig.suptitle(
                f"{bench}: speed-up of static_moe over the baselines ({self.limits.threads} threads{self._on_host()})",
                fontsize=10,
            )
            fig.tight_layout()
            paths.append(out_dir / f"{bench}_speedup.png")
            fig.savefig(paths[-1], dpi=90)
            plt.close(fig)
        return paths

    def _on_host(self) -> str:
        """`` on <host id>`` for a plot's title, where the run recorded its host (harness.hosts)."""
        host = (self.meta.get("host") or {}).get("id")
        return f" on {host}" if host else ""


def machine_meta(threads: int) -> dict:
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": threads,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _group(records: list[dict], key) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in records:
        out.setdefault(key(r), []).append(r)
    for rs in out.values():
        rs.sort(key=lambda r: r["tokens"])
    return out


def _fmt_time(s: float | None) -> str:
    if s is None:
        return "—"
    if s >= 1.0:
        return f"{s:.2f}s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f}ms"
    return f"{s * 1e6:.1f}µs"


def _fmt_num(v, spec: str) -> str:
    return "—" if v is None else spec.format(v)


def _fmt_speedup(sp: dict, record: dict, name: str) -> str:
    b = record.get("baselines", {}).get(name)
    if b is None:
        return "—"
    if not b.get("available", True):
        return "n/a"
    v = sp.get(name)
    return "—" if v is None else f"{v:.2f}"


def json_default(o):
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if hasattr(o, "__dataclass_fields__"):
        return asdict(o)
    return str(o)


def progress(rec: dict) -> None:
    """One line per measured point, while the run goes."""
    op = rec["op"]
    t = _fmt_time(op.get("median_s")) if op.get("available", True) else "n/a"
    sp = " ".join(f"×{k}={v:.2f}" for k, v in rec["speedup"].items() if v)
    frac = rec.get("roofline_fraction")
    extra = ""
    if rec.get("weight_stream_fraction"):
        extra += f" ×stream {rec['weight_stream_fraction']:.2f}"
    if rec.get("collective_share") is not None:
        extra += f" collectives {100 * rec['collective_share']:.0f}% of the step"
    if rec.get("local_experts_in_step_vs_alone"):
        extra += f"; local_experts in step / alone ×{rec['local_experts_in_step_vs_alone']:.2f}"
    print(
        f"  {rec['bench']} {rec.get('shape', '')} {rec.get('fmt', '')}"
        + (f" T={rec['tokens']}" if rec["tokens"] != "" else "")
        + f": op {t} roof "
        f"{_fmt_num(frac and 100 * frac, '{:.0f}%')} {sp}"
        + (f" parity {op['parity']}" if "parity" in op else "")
        + extra,
        flush=True,
    )
