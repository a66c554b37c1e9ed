"""The docs check: the repository documents itself, and what it says about itself resolves.

Four rules, each applied to the tree and each tried first on a crafted bad input so the rule can fail:
(a) every relative link in README.md and docs/**/*.md names a file of the repository, and its #anchor (if any)
    an anchor of that file (an explicit ``<a id="…">`` or a heading's GitHub slug);
(b) every "SPEC §n" citation in a file of the tree (code, tests, docs) names a section of docs/spec.md, and
    docs/spec.md keeps the section numbers the code has always cited (§0 … §5), each with an ``s<n>`` anchor;
(c) every fenced block opened with ```` ```python runnable ```` in README.md or docs/ runs to completion
    (a fresh interpreter, ``sys.executable``, with a timeout);
(d) no file of the tree holds an absolute path of a particular machine (a home, work or temp directory) or
    points at documents that live outside the repository.
"The tree" is what git tracks plus untracked files it does not ignore (so a new file is checked before its
first commit); binary files are skipped.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "docs" / "spec.md"
# The sections the code has cited since before docs/spec.md existed; renumbering them would orphan citations.
CITED_SINCE_THE_START = ["0", "1", "1.1", "1.2", "1.3", "1.4", "1.5", "1.6", "1.7", "1.8", "2", "3", "4", "5"]
RUNNABLE_TIMEOUT_S = 300


# --------------------------------------------------------------------------------------------------------------
# Reading the tree
# --------------------------------------------------------------------------------------------------------------


def tree_files(root: Path = REPO) -> list[Path]:
    """Tracked files plus untracked, non-ignored ones that exist on disk, as absolute paths."""
    out = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.decode()
    return sorted({root / p for p in out.split("\0") if p and (root / p).is_file()})


def read_text(path: Path) -> str | None:
    """The file as text, or None for binary files (NUL bytes or not UTF-8)."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def markdown_files(root: Path = REPO) -> list[Path]:
    return [p for p in tree_files(root) if p.suffix == ".md" and (p.parent == root or root / "docs" in p.parents)]


def rel(path: Path, root: Path = REPO) -> str:
    return str(path.relative_to(root))


# --------------------------------------------------------------------------------------------------------------
# (a) links and anchors
# --------------------------------------------------------------------------------------------------------------

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_REF = re.compile(r"<(?:img|a)\b[^>]*?\b(?:src|href)=\"([^\"]+)\"")
EXPLICIT_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose_lines(text: str, blank_code: bool = True):
    """(line number, line) of the lines outside fenced code blocks, inline code spans blanked unless told not to."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield n, INLINE_CODE.sub("``", line) if blank_code else line


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: markup and punctuation dropped, lower case, spaces → hyphens."""
    text = re.sub(r"<[^>]+>", "", heading)  # inline HTML (e.g. an explicit anchor) is not part of it
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link keeps its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(text, blank_code=False):  # a heading's code span is part of its slug
        found.update(EXPLICIT_ANCHOR.findall(line))
        m = HEADING.match(line)
        if m:
            slug = github_slug(m.group(2))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def broken_links(md: Path, root: Path = REPO) -> list[str]:
    """One message per relative link of ``md`` whose file is missing, outside ``root``, or lacks the anchor."""
    problems = []
    text = md.read_text(encoding="utf-8")
    for n, line in prose_lines(text):
        for target in LINK.findall(line) + HTML_REF.findall(line):
            if SCHEME.match(target):
                continue  # http:, https:, mailto: — not ours to resolve offline
            path_part, _, anchor = target.partition("#")
            dest = (md.parent / path_part).resolve() if path_part else md
            where = f"{rel(md, root)}:{n}: link {target!r}"
            if root.resolve() not in dest.parents and dest != root.resolve():
                problems.append(f"{where} points outside the repository")
            elif not dest.exists():
                problems.append(f"{where}: {path_part} does not exist")
            elif anchor:
                if dest.suffix != ".md":
                    problems.append(f"{where}: an anchor into a file that is not markdown")
                elif anchor not in anchors(dest.read_text(encoding="utf-8")):
                    problems.append(f"{where}: no anchor #{anchor} in {rel(dest, root.resolve())}")
    return problems


# --------------------------------------------------------------------------------------------------------------
# (b) SPEC citations
# --------------------------------------------------------------------------------------------------------------

SECTION = r"\d+(?:\.\d+)*"
# "SPEC §1.6", "SPEC §1, §4", "SPEC §1.8, §4, §5", "SPEC §1.4-1.5", "SPEC §1.2/§1.3": a list continues only with
# another "§" (after "," or "/") or with a range dash, so a number after a comma ("SPEC §2, 128 rows") is prose.
# Case-insensitive: the docs say "spec §1.8" in prose and diagrams, the code "SPEC §1.8".
CITATION = re.compile(rf"(?i:SPEC)(?:'s)?\s*§\s?({SECTION}(?:\s*[,/]\s*§\s?{SECTION}|\s*[–-]\s*§?\s?{SECTION})*)")
SPEC_HEADING = re.compile(rf"^#{{1,6}}\s+§({SECTION})\b")
BARE_REF = re.compile(rf"§\s?({SECTION})")


def spec_sections(spec_text: str) -> dict[str, bool]:
    """Section number → whether it carries its explicit ``<a id="s<n>">`` anchor (on the heading or the line above)."""
    out = {}
    previous = ""
    for _, line in prose_lines(spec_text):
        m = SPEC_HEADING.match(line)
        if m:
            out[m.group(1)] = f'id="s{m.group(1)}"' in line or f'id="s{m.group(1)}"' in previous
        if line.strip():
            previous = line
    return out


def citations(text: str) -> list[tuple[int, str]]:
    """(line, section) for every section named by a "SPEC §…" citation; both ends of a range."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        for m in CITATION.finditer(line):
            out += [(n, s) for s in re.findall(SECTION, m.group(1))]
    return out


def dangling_citations(files: list[Path], sections, root: Path = REPO) -> list[str]:
    problems = []
    for f in files:
        text = read_text(f)
        if text is None:
            continue
        for n, s in citations(text):
            if s not in sections:
                problems.append(f"{rel(f, root)}:{n}: cites SPEC §{s}, which docs/spec.md does not have")
    return problems


# --------------------------------------------------------------------------------------------------------------
# (c) runnable examples
# --------------------------------------------------------------------------------------------------------------

RUNNABLE_OPEN = re.compile(r"^```python\s+runnable\s*$")


def runnable_blocks(text: str) -> list[tuple[int, str]]:
    """(line of the opening fence, code) of every ```` ```python runnable ```` block; an unclosed one is an error."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if RUNNABLE_OPEN.match(lines[i].strip()):
            start, body = i + 1, []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith("```"):
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise ValueError(f"line {start}: runnable block never closed")
            blocks.append((start, "\n".join(body) + "\n"))
        i += 1
    return blocks


def run_block(code: str, cwd: Path, timeout: float = RUNNABLE_TIMEOUT_S) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def all_runnable_blocks() -> list[tuple[str, str]]:
    return [(f"{rel(md)}:{n}", code) for md in markdown_files() for n, code in runnable_blocks(md.read_text())]


# --------------------------------------------------------------------------------------------------------------
# (d) paths of a particular machine, documents outside the repository
# --------------------------------------------------------------------------------------------------------------

# Absolute paths that only exist on someone's machine: home, work, scratch and temp directories. System paths
# a program legitimately names (/dev/null, /proc/cpuinfo, /usr/bin/env, /usr/local/cuda) are not in the list.
MACHINE_PATH = re.compile(r"(?<![\w.~/-])/(?:work|home|root|tmp|Users|mnt|scratch|private/var)/")
# Documents this repository was started from that do not ship with it (its own contract is docs/spec.md).
OUTSIDE_DOC = re.compile(
    r"\.\./shared\b|\bshared/(?:docs|seeds)\b|\b(?:BENCH|STYLE|SPEC)\.md\b"
    r"|\bNKI_(?:NOTES|API|IDIOMS)\b|\bdeepinfer_static_mo[e]\b|\bmega_moe_module_coverag[e]\b"
)


def outside_references(text: str) -> list[tuple[int, str]]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        out += [(n, m.group(0)) for m in MACHINE_PATH.finditer(line)]
        out += [(n, m.group(0)) for m in OUTSIDE_DOC.finditer(line)]
    return out


def files_pointing_outside(files: list[Path], root: Path = REPO) -> list[str]:
    problems = []
    for f in files:
        text = read_text(f)
        if text is None:
            continue
        problems += [f"{rel(f, root)}:{n}: {what!r}" for n, what in outside_references(text)]
    return problems


# ==============================================================================================================
# The checks on the repository
# ==============================================================================================================


def test_links_and_anchors_resolve():
    problems = [p for md in markdown_files() for p in broken_links(md)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_spec_keeps_the_cited_sections_with_anchors():
    sections = spec_sections(SPEC.read_text(encoding="utf-8"))
    missing = [s for s in CITED_SINCE_THE_START if s not in sections]
    assert not missing, f"docs/spec.md lacks sections the code cites: {missing}"
    unanchored = [s for s, has in sections.items() if not has]
    assert not unanchored, f'docs/spec.md sections without an explicit <a id="s<n>"> anchor: {unanchored}'


def test_every_spec_citation_names_a_section():
    sections = spec_sections(SPEC.read_text(encoding="utf-8"))
    problems = dangling_citations(tree_files(), sections)
    # Inside the spec, a bare "§n" is a citation too.
    spec_text = SPEC.read_text(encoding="utf-8")
    problems += [
        f"docs/spec.md:{n}: §{s} does not exist"
        for n, line in enumerate(spec_text.splitlines(), 1)
        for s in BARE_REF.findall(line)
        if s not in sections
    ]
    assert not problems, "\n".join(problems)


def test_there_are_runnable_examples():
    assert any(name.startswith("README.md:") for name, _ in all_runnable_blocks()), (
        "README.md's quick start must be a ```python runnable block"
    )


@pytest.mark.parametrize("name,code", all_runnable_blocks(), ids=[n for n, _ in all_runnable_blocks()])
def test_runnable_example_runs(name, code, tmp_path):
    r = run_block(code, tmp_path)
    assert r.returncode == 0, f"{name} failed (exit {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"


def test_nothing_points_outside_the_repository():
    problems = files_pointing_outside(tree_files())
    assert not problems, "files that name a machine path or a document outside the repository:\n" + "\n".join(problems)


# ==============================================================================================================
# The checkers on crafted inputs: each must catch what it exists to catch, and pass what is fine
# ==============================================================================================================


@pytest.fixture
def fake_repo(tmp_path) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "spec.md").write_text(
        '<a id="s1"></a>\n## §1 Formats\n\n<a id="s1.6"></a>\n### §1.6 Expert GEMM\n\n### §2 Tolerances\n'
    )
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## Two `words` here\n\n## Two words here\n")
    return tmp_path


def test_link_checker_catches_missing_files_anchors_and_escapes(fake_repo):
    md = fake_repo / "README.md"
    md.write_text(
        "\n".join(
            [
                "[ok](docs/spec.md) [ok](docs/spec.md#s1.6) [ok](docs/other.md#two-words-here-1) [web](https://x.org/a)",
                "[ok](#title) ![ok](docs/other.md)",
                "# Title",
                "[gone](docs/missing.md)",
                "[no anchor](docs/spec.md#s9)",
                "[outside](../elsewhere/file.md)",
                '<img src="docs/img/none.png">',
                "```",
                "[inside a code block](nowhere.md)",
                "```",
                "`[inline code](nowhere.md)`",
            ]
        )
    )
    problems = broken_links(md, fake_repo)
    assert len(problems) == 4, problems
    assert "missing.md does not exist" in problems[0]
    assert "no anchor #s9" in problems[1]
    assert "outside the repository" in problems[2]
    assert "none.png does not exist" in problems[3]


def test_slugs_follow_github():
    assert github_slug('§1.6 Expert GEMM — "per-expert masked GEMM"') == "16-expert-gemm--per-expert-masked-gemm"
    assert github_slug("The layer: `torch.ops.static_moe.forward`") == "the-layer-torchopsstatic_moeforward"
    assert anchors("# A\n# A\n") == {"a", "a-1"}


def test_citation_checker_catches_missing_sections(fake_repo):
    sections = spec_sections((fake_repo / "docs" / "spec.md").read_text())
    assert sections == {"1": True, "1.6": True, "2": False}
    src = fake_repo / "code.py"
    spec = "SPEC"  # spelled apart so the repository-wide check does not read these crafted citations
    src.write_text(
        f"# {spec} §1.6, §2 and {spec} §1-1.6 are fine; {spec} §2, 128 rows is prose\n"
        f"x = 1  # {spec} §1.9 is not a section\n# {spec} §1, §7: the second is missing\n"
    )
    assert dangling_citations([src], sections, fake_repo) == [
        f"code.py:2: cites {spec} §1.9, which docs/spec.md does not have",
        f"code.py:3: cites {spec} §7, which docs/spec.md does not have",
    ]
    assert [s for _, s in citations("SPEC §1.4–1.5 and SPEC §1.2/§1.3.")] == ["1.4", "1.5", "1.2", "1.3"]
    assert [s for _, s in citations("the spec's §6.1, Spec §2")] == ["6.1", "2"]


def test_runnable_checker_runs_blocks_and_reports_failures(tmp_path):
    text = "\n".join(
        [
            "```python",
            "raise SystemExit(3)  # not marked: never run",
            "```",
            "```python runnable",
            "print('hello')",
            "```",
            "```python runnable",
            "import sys",
            "sys.exit(3)",
            "```",
        ]
    )
    blocks = runnable_blocks(text)
    assert [n for n, _ in blocks] == [4, 7]
    ok, bad = (run_block(code, tmp_path, timeout=60) for _, code in blocks)
    assert ok.returncode == 0 and ok.stdout == "hello\n"
    assert bad.returncode == 3
    with pytest.raises(subprocess.TimeoutExpired):
        run_block("while True: pass\n", tmp_path, timeout=2)
    with pytest.raises(ValueError, match="never closed"):
        runnable_blocks("```python runnable\nprint(1)\n")


def test_outside_reference_checker(tmp_path):
    bad = "\n".join(
        [
            "see " + "/" + "work/shared/x",
            "cat " + "/" + "home/u",
            "open('" + "/" + "tmp/a')",
            "../" + "shared" + "/docs/x",
            "docs " + "BENCH" + ".md",
            "the " + "NKI" + "_NOTES figures",
            "root = '" + "/" + "root/.cache'",
        ]
    )
    found = outside_references(bad)
    assert [n for n, _ in found] == [1, 2, 3, 4, 5, 6, 7], found
    fine = "\n".join(
        [
            "#!/usr/bin/env bash",
            "open('/dev/null')",
            "Path('/proc/cpuinfo')",
            "/usr/local/cuda/include",
            "docs/spec.md and docs/benchmarks.md",
            "https://example.org/work/page",
            "a/tmp/b, seed_dense",
        ]
    )
    assert outside_references(fine) == []
    f = tmp_path / "x.py"
    f.write_text(bad)
    (tmp_path / "binary.png").write_bytes(b"\x89PNG\0/" + b"work/")
    assert len(files_pointing_outside([f, tmp_path / "binary.png"], tmp_path)) == 7
