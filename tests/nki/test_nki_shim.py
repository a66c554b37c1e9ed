"""static_moe.nki.shim, the one place kernels get ``nl`` / ``nisa`` from: the real NKI when importable, else the
repository's NKI interpreter (``nki_interpreter`` in tools/, which the wheel does not ship), else a clear
ImportError. ``import static_moe`` imports neither the shim nor the interpreter. The import checks run in a fresh
interpreter, so what other tests imported does not count."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from nki_interpreter import isa as nisa
from nki_interpreter import language as nl

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _run(code: str, cwd: Path, pythonpath: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "STATIC_MOE_NKI"}
    env["PYTHONPATH"] = os.pathsep.join(pythonpath + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, cwd=cwd, env=env
    )


def test_shim_falls_back_to_the_interpreter_and_maps_dtypes():
    from static_moe.nki import shim

    if not shim.real_nki_available():
        assert shim.nl is nl and shim.nisa is nisa and shim.BACKEND == "interpreter"
    assert shim.nl_dtype(torch.float8_e4m3fn) == shim.nl.float8_e4m3fn
    with pytest.raises(ValueError, match="int64"):
        shim.nl_dtype(torch.int64)


def test_import_static_moe_does_not_import_the_interpreter(tmp_path):
    """With the interpreter importable (tools/ on the path), ``import static_moe`` still leaves it, the shim and
    the kernels unimported: they load on the first NKI call."""
    out = _run(
        """
        import sys
        import static_moe
        loaded = sorted(m for m in sys.modules
                        if m.startswith(("nki_interpreter", "static_moe.nki.shim", "static_moe.nki_kernels")))
        assert not loaded, loaded
        import nki_interpreter  # importable here, so the check above could have failed
    """,
        tmp_path,
        [str(TOOLS)],
    )
    assert out.returncode == 0, out.stderr


def test_without_nki_or_the_interpreter_the_kernels_say_what_to_install(tmp_path):
    """Neither a real nki nor the interpreter (as in an installed wheel off a Neuron machine): static_moe imports,
    ``dispatch.status()`` gives the reason, and importing a kernel raises an ImportError that names both."""
    out = _run(
        """
        import sys
        sys.modules["nki"] = None  # makes `import nki` raise ImportError
        sys.modules["nki_interpreter"] = None
        import static_moe
        from static_moe.nki import dispatch
        s = dispatch.status()
        assert s["interpreter"] is False and s["simulator"] is None, s
        print("status:", s["interpreter_why_not"])
        try:
            import static_moe.nki_kernels.expert_gemm
        except ImportError as e:
            print("ImportError:", e)
    """,
        tmp_path,
        [],
    )
    assert out.returncode == 0, out.stderr
    for line in ("status: ", "ImportError: "):
        assert f"{line}static_moe's NKI kernels need the Neuron SDK's nki" in out.stdout, out.stdout
        assert "the repository's tools/ directory on sys.path" in out.stdout, out.stdout
