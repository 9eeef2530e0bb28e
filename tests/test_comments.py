"""The product's comments say why, in the present tense: no version tags, no citations of the lab's notebook, no
microsecond histories, no tombstones. The history lives in lab/ and in git.

Checked: the comments and string literals (docstrings, help texts) of atomflow_bench/**/*.py and the comments of
kernels_cu/**/*.cu, *.cuh, outside any `lab` folder."""
import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# A version tag: v45, (v28), v23.5, v7.1-v9; not a URL path (/v1/completions), a PTX suffix (.v4.u32) or an identifier.
VERSION_TAG = re.compile(r"(?<![\w/.])v\d+(?:\.\d+)*(?![\w/])")
RULES = {
    "version tag": VERSION_TAG,
    "notebook citation": re.compile(r"PERF_NOTES"),
    "tombstone": re.compile(r"last in commit|\bcommit [0-9a-f]{7,40}\b", re.I),
    "microsecond delta": re.compile(r"[+\-−]\d+(?:\.\d+)? ?(?:us|µs)\b"),
    "history": re.compile(r"\bgroundwork\b", re.I),
}


def python_text(source: str) -> list[tuple[int, str]]:
    """(first line, text) of every comment and string literal of a Python source."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING) or tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            out.append((tok.start[0], tok.string))
    return out


def c_comments(source: str) -> list[tuple[int, str]]:
    """(first line, text) of every // and /* */ comment of a C++/CUDA source (string and char literals skipped)."""
    out, i, n = [], 0, len(source)
    while i < n:
        c = source[i]
        if source.startswith("//", i):
            j = source.find("\n", i)
            j = n if j < 0 else j
            out.append((source.count("\n", 0, i) + 1, source[i:j]))
            i = j
        elif source.startswith("/*", i):
            j = source.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append((source.count("\n", 0, i) + 1, source[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and source[j] != c and source[j] != "\n":
                j += 2 if source[j] == "\\" else 1
            i = j + 1
        else:
            i += 1
    return out


def offences(path: Path) -> list[str]:
    """'path:line: rule: excerpt' for every rule a comment (or, in Python, a string) of `path` breaks."""
    source = path.read_text()
    pieces = python_text(source) if path.suffix == ".py" else c_comments(source)
    found = []
    for line, text in pieces:
        for rule, pattern in RULES.items():
            for m in pattern.finditer(text):
                at = line + text.count("\n", 0, m.start())
                found.append(f"{path.relative_to(ROOT)}:{at}: {rule}: {m.group(0)!r}")
    return found


def product_files() -> list[Path]:
    files = list((ROOT / "atomflow_bench").rglob("*.py"))
    files += [p for ext in ("*.cu", "*.cuh") for p in (ROOT / "kernels_cu").rglob(ext)]
    return sorted(p for p in files if "lab" not in p.relative_to(ROOT).parts)


def test_rules_find_what_they_should_and_nothing_else(tmp_path):
    bad_py = tmp_path / "bad.py"
    bad_py.write_text('"""Groundwork for v46.6."""\nX = 1  # (v28) -34 us faster; removed; last in\n# commit 9969095\n'
                      "Y = 2  # see docs/PERF_NOTES.md v7.1-v9, +6 to +21 µs\n")
    good_py = tmp_path / "good.py"
    good_py.write_text('"""Streams /v1/completions."""\nv10 = x.v4 + 3  # 8 us per launch, 3 µs apart\n'
                       'URL = "http://h/v1"  # removed rows: the commit pins them\n')
    bad_cu = tmp_path / "bad.cu"
    bad_cu.write_text('// v23.5: the split kernel\n/* first\n   PERF_NOTES v30 */\nasm("ld.global.v4.u32");\n')
    good_cu = tmp_path / "good.cu"
    good_cu.write_text('asm("ld.global.nc.v4.u32 {%0}, [%1];");  // 16-byte loads\nint v1 = 2;\n')
    global ROOT
    root, ROOT = ROOT, tmp_path
    try:
        bad = offences(bad_py) + offences(bad_cu)
        assert offences(good_py) == [] and offences(good_cu) == []
    finally:
        ROOT = root
    rules = [b.split(": ")[1] for b in bad]
    assert rules.count("version tag") == 6 and rules.count("notebook citation") == 2
    assert rules.count("tombstone") == 1 and rules.count("microsecond delta") == 2 and rules.count("history") == 1
    assert "bad.py:4: notebook citation: 'PERF_NOTES'" in bad and "bad.cu:3: version tag: 'v30'" in bad
    assert "bad.py:3: tombstone: 'commit 9969095'" in bad


def test_product_comments_carry_no_history():
    files = product_files()
    assert any(p.suffix == ".cuh" for p in files) and any(p.name == "cli.py" for p in files)
    found = [o for p in files for o in offences(p)]
    assert not found, f"{len(found)} history fragments in the product's comments (say why, in the present tense):\n" \
                      + "\n".join(found)


# ---- the wheel's text names only what a wheel user has ------------------------------------------------------------
# scripts/ and lab/ hold the repository's programs; the wheel does not ship them (test_packaging._TOP: what it is
# built from), so a message or help text of the package must not send its user there.
REPO_PROGRAM = re.compile(r"(?<![\w/.-])(?:scripts|lab)/[\w.-]+(?:/[\w.-]+)*")


def repo_programs(source: str) -> list[tuple[int, str]]:
    """(line, path) of every scripts/ or lab/ path a string literal of a Python `source` names; its module docstring
    aside (read in the source, never printed: the CLI's help comes from the commands' own docstrings)."""
    tree = ast.parse(source)
    first = tree.body[0] if tree.body else None
    doc = first.value if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) else None
    return [(node.lineno, m.group(0).rstrip(".")) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node is not doc
            for m in REPO_PROGRAM.finditer(node.value)]


def test_the_repository_program_check_can_fail():
    src = ('"""Made by scripts/gen.py."""\nA = "run scripts/gen_ground_truth.py MODEL"\n'
           'def f(x):\n    """See lab/timeline.py."""\n    return f"{x}: see lab/records/x.json; results/run-1.json"\n')
    assert repo_programs(src) == [(2, "scripts/gen_ground_truth.py"), (4, "lab/timeline.py"),
                                  (5, "lab/records/x.json")]


def test_package_text_names_no_program_the_wheel_lacks():
    from test_packaging import _TOP

    assert not {"scripts", "lab"} & set(_TOP)
    found = [f"{p.relative_to(ROOT)}:{line}: {path}" for p in sorted((ROOT / "atomflow_bench").rglob("*.py"))
             for line, path in repo_programs(p.read_text())]
    assert not found, "the package names repository programs its wheel does not ship:\n" + "\n".join(found)
