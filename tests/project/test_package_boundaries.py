"""The package's production code stands without its reference: no module of static_moe other than the reference
ops themselves (static_moe/reference/), the testing helpers (static_moe/testing/) and the self-checking demo
(static_moe/demo.py) imports static_moe.reference; nor does an NKI kernel (nki_kernels/, installed as
static_moe.nki_kernels). The reference may import production helpers (the packed row layout, the formats); the
other way round, a kernel's behaviour would depend on its own specification.
Read from the source with ``ast``: nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "static_moe"
KERNELS = Path(__file__).resolve().parents[2] / "nki_kernels"  # static_moe.nki_kernels (setup.py's package_dir)
REFERENCE = "static_moe.reference"
NOT_PRODUCTION = ("reference", "testing", "demo.py")  # first path part under static_moe/


def module_name(path: Path) -> str:
    """static_moe.ops.forward for python/static_moe/ops/forward.py; static_moe.ops for ops/__init__.py;
    static_moe.nki_kernels.pack_rows for nki_kernels/pack_rows.py."""
    if path.is_relative_to(KERNELS):
        parts = ("static_moe", "nki_kernels", *path.relative_to(KERNELS).with_suffix("").parts)
    else:
        parts = ("static_moe", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, name: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module name) of every module an ``import`` / ``from … import`` in ``source`` may load,
    relative imports resolved against module ``name``; ``from a import b`` gives both a and a.b (b may be a
    submodule)."""
    package = name.split(".") if is_package else name.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.append((node.lineno, mod))
            out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
    return out


def reference_imports(source: str, name: str, is_package: bool = False) -> list[str]:
    """ "line n: module" for every import statement of ``source`` that may load static_moe.reference (one each)."""
    hits: dict[int, str] = {}
    for line, mod in imported_modules(source, name, is_package):
        if mod == REFERENCE or mod.startswith(REFERENCE + "."):
            hits.setdefault(line, mod)
    return [f"line {line}: {mod}" for line, mod in sorted(hits.items())]


def production_files() -> list[Path]:
    package = [p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] not in NOT_PRODUCTION]
    return sorted(package + list(KERNELS.rglob("*.py")))


def test_the_check_finds_every_spelling_of_a_reference_import():
    """Tried first on crafted sources, so the check below can fail."""
    for source in (
        "from ..reference.pack_rows import aligned",
        "from .. import reference",
        "import static_moe.reference.forward",
        "from static_moe.reference import forward",
    ):
        assert reference_imports(source, "static_moe.ops.forward"), source
    assert reference_imports("from . import reference", "static_moe", is_package=True)
    assert reference_imports("from .reference import pack_rows", "static_moe.workspace")
    for source in (
        "from ..packed_layout import aligned",
        "from . import step_status",
        "from .. import reference_free",
        "import static_moe",
    ):
        assert not reference_imports(source, "static_moe.ops.forward"), source


def test_production_modules_import_nothing_from_the_reference():
    files = production_files()
    assert PACKAGE / "module.py" in files and PACKAGE / "ops" / "forward.py" in files
    assert KERNELS / "pack_rows.py" in files
    assert module_name(KERNELS / "pack_rows.py") == "static_moe.nki_kernels.pack_rows"
    found = {}
    for path in files:
        hits = reference_imports(path.read_text(), module_name(path), path.name == "__init__.py")
        if hits:
            found[str(path.relative_to(PACKAGE.parents[1]))] = hits
    assert not found, f"production modules import static_moe.reference (move what they need out of it): {found}"
