"""The README's two commands are the project's contract: CI runs the test command verbatim. The README stays a guide
of at most 180 lines, and every relative link of the README, docs/ and the lab's and results' indexes resolves."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    blocks = section.split("```")[1::2]
    return [b.strip() for b in blocks]


def test_readme_has_exactly_two_commands():
    cmds = readme_commands()
    assert len(cmds) == 2 and all("\n" not in c for c in cmds)
    assert cmds[0].endswith("atomflow-bench run")


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in ci


# ---- the guide's size and its links -------------------------------------------------------------------------
LINKED_PAGES = ("README.md", "docs/*.md", "lab/README.md", "lab/records/README.md", "results/README.md")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_links(page: Path) -> list[str]:
    """The relative links of `page` whose file or directory is missing, or whose #anchor no heading of the target has."""
    bad = []
    for target in _LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not this repository's
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
        elif anchor and (dest.is_dir() or anchor not in {slug(h) for h in re.findall(r"^#+ (.+)$", dest.read_text(), re.M)}):
            bad.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    return bad


def test_the_link_check_can_fail(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "there.md").write_text("# A heading (`with/code`)\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md) [ok](there.md#a-heading-withcode) [web](https://example.com) [self](#top)\n"
                    "# top\n[gone](missing.json) ![img](img/x.png) [anchor](there.md#nowhere)\n")
    assert broken_links(page) == ["page.md: missing.json (no such file)", "page.md: img/x.png (no such file)",
                                  "page.md: there.md#nowhere (no such heading)"]
    assert slug("Ours and llama.cpp on one H100 (results/engines-h100)") == "ours-and-llamacpp-on-one-h100-resultsengines-h100"


def test_every_relative_link_resolves():
    pages = sorted({p for pattern in LINKED_PAGES for p in ROOT.glob(pattern)})
    assert ROOT / "README.md" in pages and len(pages) >= 6
    assert [b for p in pages for b in broken_links(p)] == []


def test_readme_is_a_guide_and_results_holds_only_linked_records():
    """The README stays a user's guide (<= 180 lines; measured essays live in docs/), and results/ holds the CI gate's
    references and the records the tables link (<= 80 files), the rest in lab/records/."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 180
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: tracked files unknown")
    tracked = subprocess.run(["git", "ls-files", "results"], cwd=ROOT, capture_output=True, text=True, check=True)
    files = tracked.stdout.split()
    assert 0 < len(files) <= 80 and "results/reference/llama-3.2-3b-fp8-ctx128.json" in files
    assert not [f for f in files if re.match(r"results/v\d", f)], "per-version records belong in lab/records/"
