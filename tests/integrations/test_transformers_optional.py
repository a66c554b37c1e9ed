"""transformers is an optional dependency: static_moe imports without it, and the integration says which extra
to install. Runs in a fresh interpreter where ``import transformers`` fails."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_static_moe_imports_without_transformers():
    code = textwrap.dedent("""
        import sys
        sys.modules["transformers"] = None  # makes `import transformers` raise ImportError
        import static_moe, static_moe.integrations
        from static_moe import StaticMoE
        assert "transformers" not in {m.split(".")[0] for m in sys.modules if sys.modules[m] is not None}
        try:
            import static_moe.integrations.transformers
        except ImportError as e:
            print("ImportError:", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (
        "ImportError: static_moe.integrations.transformers needs transformers>=5: pip install "
        "'static_moe[transformers]'" in out.stdout
    ), out.stdout
