"""Fault injection on the test suite: apply each mutant of tests/mutants.py to a scratch copy of the repository,
rebuild, run the tests that should catch it, and report killed / survived. Not part of `make test` (one C++
rebuild per kernel mutant): run it with `make mutate` or

    .venv/bin/python tests/mutate.py [--only SUBSTRING ...] [--scratch DIR] [--timeout S] [--selection-only] [--list]

The scratch copy lives outside the repository (default: $TMPDIR/static_moe_mutate) and is kept between runs, so
its build directory lets ninja recompile only the files a mutant touches (MAX_JOBS=1 unless set). Before any
mutant, every test selection of the table runs on the unmutated copy and must pass — otherwise a "killed" would
mean nothing. Each mutant runs its own selection first (a fast kill); one that survives it then runs the whole
suite (``pytest -x tests``), so the table is judged against everything the suite asserts. A mutant the selection
kills is killed by the whole suite too (the selection is a subset of it), so the whole suite runs only for
survivors; ``--selection-only`` skips it (a quick pass). A mutant whose rebuild fails counts as an error, not as killed. Exit status 0 only when every
selected mutant is killed. The last result is written to <scratch>/last_result.json and printed as a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from mutants import MUTANTS, Mutant  # noqa: E402

NATIVE = (".cpp", ".h", ".cu", ".cuh")


def tracked_files(repo: Path) -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [f for f in out.splitlines() if (repo / f).is_file()]


def sync(repo: Path, src: Path) -> None:
    """Copy the working tree into src, rewriting only files whose bytes differ (keeps mtimes for ninja)."""
    for rel in tracked_files(repo):
        a, b = repo / rel, src / rel
        data = a.read_bytes()
        if b.is_file() and b.read_bytes() == data:
            continue
        b.parent.mkdir(parents=True, exist_ok=True)
        b.write_bytes(data)


def link_kernels(src: Path) -> None:
    """The NKI kernels (nki_kernels/) install as ``static_moe.nki_kernels`` through setup.py's package_dir; the
    scratch copy runs from its source folders instead, so it reaches them through a link
    python/static_moe/nki_kernels -> nki_kernels (found before any installed copy of the package)."""
    link = src / "python" / "static_moe" / "nki_kernels"
    if not link.is_symlink():
        link.symlink_to(Path("..", "..", "nki_kernels"), target_is_directory=True)


def env_for(src: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(src / "python"), str(src / "tools")])
    env.setdefault("MAX_JOBS", "1")
    env.setdefault("OMP_NUM_THREADS", "2")
    env["STATIC_MOE_FORCE_CPU"] = "1"
    env.pop("STATIC_MOE_CPU_ISA", None)
    return env


def run(cmd: list[str], cwd: Path, env: dict, timeout: float) -> tuple[int, str, float]:
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout + p.stderr, time.monotonic() - t0
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, out + f"\n[timed out after {timeout:.0f} s]", time.monotonic() - t0


def build(src: Path, env: dict) -> tuple[bool, str]:
    rc, out, _ = run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], src, env, 3600)
    return rc == 0, out


def asan(src: Path, env: dict, timeout: float) -> tuple[int, str]:
    exe = src / "build" / "asan" / "pack_rows_asan"
    exe.parent.mkdir(parents=True, exist_ok=True)
    rc, out, _ = run(
        [
            os.environ.get("CXX", "g++"),
            "-std=c++17",
            "-O1",
            "-g",
            "-fsanitize=address",
            "-fno-omit-frame-pointer",
            "-fopenmp",
            "-Icsrc",
            "tests/asan/pack_rows_asan.cpp",
            "-o",
            str(exe),
        ],
        src,
        env,
        timeout,
    )
    if rc != 0:
        return -1, out
    rc, out2, _ = run([str(exe)], src, {**env, "ASAN_OPTIONS": "detect_leaks=0"}, timeout)
    return rc, out + out2


def pytest(src: Path, env: dict, args: tuple[str, ...], timeout: float) -> tuple[int, str, float]:
    return run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *args], src, env, timeout)


def check_imports_scratch(src: Path, env: dict) -> None:
    rc, out, _ = run(
        [
            sys.executable,
            "-c",
            "import static_moe, static_moe.nki_kernels, nki_interpreter; "
            "print(static_moe.__file__); print(static_moe.nki_kernels.__file__); "
            "print(nki_interpreter.__file__)",
        ],
        src,
        env,
        300,
    )
    paths = out.split()
    if rc != 0 or not all(Path(p).resolve().is_relative_to(src.resolve()) for p in paths[-3:]):
        sys.exit(f"mutate: the scratch copy does not import its own package (got {out.strip()!r})")


def apply(mutant: Mutant, repo: Path, src: Path) -> None:
    text = (repo / mutant.file).read_text()
    n = text.count(mutant.old)
    if n != 1:
        raise ValueError(f"mutant {mutant.name!r}: its old text occurs {n} times in {mutant.file} (must be once)")
    (src / mutant.file).write_text(text.replace(mutant.old, mutant.new))


def restore(mutant: Mutant, repo: Path, src: Path) -> None:
    (src / mutant.file).write_bytes((repo / mutant.file).read_bytes())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()) / "static_moe_mutate")
    ap.add_argument("--only", nargs="*", default=None, help="run the mutants whose name contains any of these")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per test run")
    ap.add_argument("--list", action="store_true", help="print the table and exit")
    ap.add_argument("--skip-baseline", action="store_true", help="trust that the selections pass unmutated")
    ap.add_argument(
        "--selection-only", action="store_true", help="judge each mutant by its selection only (no whole-suite run)"
    )
    ap.add_argument("--suite-timeout", type=float, default=3600, help="seconds for a whole-suite run")
    a = ap.parse_args()

    mutants = [m for m in MUTANTS if a.only is None or any(s in m.name for s in a.only)]
    for m in mutants:  # every old text must be found exactly once before anything runs
        text = (REPO / m.file).read_text()
        if text.count(m.old) != 1:
            sys.exit(f"mutate: {m.name!r}: old text occurs {text.count(m.old)} times in {m.file}")
    if a.list:
        for m in mutants:
            print(f"{m.name:70s} {m.file}")
        return 0
    if a.scratch.resolve().is_relative_to(REPO):
        sys.exit("mutate: the scratch directory must lie outside the repository")
    src = a.scratch / "src"
    src.mkdir(parents=True, exist_ok=True)
    env = env_for(src)
    sync(REPO, src)
    link_kernels(src)
    print(f"mutate: scratch copy {src}; building (MAX_JOBS={env['MAX_JOBS']}) ...", flush=True)
    ok, out = build(src, env)
    if not ok:
        print(out[-4000:])
        sys.exit("mutate: the unmutated scratch copy does not build")
    check_imports_scratch(src, env)

    if not a.skip_baseline:
        selections = sorted({m.tests for m in mutants})
        for sel in selections:
            rc, out, dt = pytest(src, env, sel, a.timeout)
            print(f"baseline {' '.join(sel)}: {'ok' if rc == 0 else 'FAILS'} ({dt:.0f} s)", flush=True)
            if rc != 0:
                print(out[-4000:])
                sys.exit("mutate: a test selection fails without any mutant; fix that first")
        if any(m.asan for m in mutants):
            rc, out = asan(src, env, a.timeout)
            if rc != 0:
                print(out[-4000:])
                sys.exit("mutate: the ASan driver fails without any mutant")

    # Python mutants first (no rebuild), then the native ones grouped by file (ninja recompiles one object).
    order = sorted(mutants, key=lambda m: (m.file.endswith(NATIVE), m.file))
    results = []
    dirty_native = False
    for m in order:
        native = m.file.endswith(NATIVE)
        t0 = time.monotonic()
        apply(m, REPO, src)
        status, detail = "survived", ""
        try:
            if native:
                dirty_native = True
                ok, out = build(src, env)
                if not ok:
                    status, detail = "error", "build failed: " + out.strip().splitlines()[-1][:200]
            if status == "survived":
                rc, out, _ = pytest(src, env, m.tests, a.timeout)
                if rc == 124:
                    status, detail = "killed", "tests timed out"
                elif rc not in (0, 5):
                    failed = [ln for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR"))]
                    status, detail = "killed", (failed[0] if failed else out.strip().splitlines()[-1])[:200]
                elif rc == 5:
                    status, detail = "error", "the selection collected no tests"
            if status == "survived" and not a.selection_only:
                rc, out, _ = pytest(src, env, ("tests",), a.suite_timeout)
                if rc == 124:
                    status, detail = "killed", "whole suite timed out"
                elif rc != 0:
                    failed = [ln for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR"))]
                    status, detail = (
                        "killed",
                        "whole suite: " + (failed[0] if failed else out.strip().splitlines()[-1])[:180],
                    )
            if status == "survived" and m.asan:
                rc, out = asan(src, env, a.timeout)
                if rc > 0:
                    line = next(
                        (ln for ln in out.splitlines() if "ERROR: AddressSanitizer" in ln or "FAIL" in ln),
                        out.strip().splitlines()[-1] if out.strip() else "",
                    )
                    status, detail = "killed", "ASan: " + line.strip()[:180]
                elif rc < 0:
                    status, detail = "error", "ASan driver did not build"
        finally:
            restore(m, REPO, src)
        dt = time.monotonic() - t0
        results.append({"name": m.name, "file": m.file, "status": status, "detail": detail, "seconds": round(dt)})
        print(f"{status.upper():8s} {m.name}  ({dt:.0f} s) {detail}", flush=True)
    if dirty_native:
        build(src, env)  # leave the scratch build unmutated for the next run

    killed = sum(r["status"] == "killed" for r in results)
    summary = {
        "killed": killed,
        "total": len(results),
        "survived": [r["name"] for r in results if r["status"] == "survived"],
        "errors": [r["name"] for r in results if r["status"] == "error"],
        "results": results,
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "mode": "selection only" if a.selection_only else "selection, then the whole suite for survivors",
    }
    (a.scratch / "last_result.json").write_text(json.dumps(summary, indent=1))
    print(
        f"\nmutate: {killed} of {len(results)} mutants killed; survived: {summary['survived'] or 'none'}; "
        f"errors: {summary['errors'] or 'none'} (written to {a.scratch / 'last_result.json'})"
    )
    return 0 if killed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
