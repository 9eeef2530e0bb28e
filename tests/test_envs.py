"""The environment variables: envs.py is their only reader, README.md's table matches it, and the parsers do what the
table says."""
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from atomflow_bench import envs
from atomflow_bench.errors import AtomflowError

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "atomflow_bench"
OS_ENV = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def env_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for every use of the process environment through `os` in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in OS_ENV and isinstance(node.value, ast.Name) \
                and node.value.id == "os":
            found.append((node.lineno, f"os.{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [(node.lineno, f"from os import {a.name}") for a in node.names if a.name in OS_ENV]
    return found


def product_files():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if "lab" not in rel.parts and rel != Path("envs.py"):
            yield path


def test_env_uses_finds_reads_and_writes():
    src = ("import os\nfrom os import environ, getenv\na = os.environ.get('ATOMFLOW_HOME')\nb = os.getenv('RANK')\n"
           "c = 'RANK' in os.environ\nos.environ.setdefault('NCCL_NVLS_ENABLE', '0')\nd = os.path.join('a')\n")
    assert sorted(ln for ln, _ in env_uses(src)) == [2, 2, 3, 4, 5, 6]


def test_only_envs_reads_the_environment():
    """No module of the product but envs.py touches os.environ / os.getenv (a child's environment comes from
    envs.rank_environment, a default from envs.set_default)."""
    hits = [f"{p.relative_to(ROOT)}:{ln}: {what}" for p in product_files() for ln, what in env_uses(p.read_text())]
    assert not hits, "read the environment through atomflow_bench.envs:\n" + "\n".join(hits)


def test_every_variable_the_product_names_is_declared():
    """An ATOMFLOW_* name in the product's text (help, errors, docstrings) is a declared variable."""
    names = {(p.relative_to(ROOT), m) for p in product_files() for m in re.findall(r"\bATOMFLOW_[A-Z_]+", p.read_text())}
    undeclared = sorted(f"{p}: {n}" for p, n in names if n not in envs.VARIABLES)
    assert not undeclared, undeclared
    assert len({n for _, n in names}) >= 6  # the scan reads the product's files


def readme_table() -> dict[str, tuple[str, str]]:
    text = (ROOT / "README.md").read_text()
    assert "\n## Environment variables\n" in text, "README.md has no '## Environment variables' section"
    section = text.split("\n## Environment variables\n", 1)[1].split("\n## ", 1)[0]
    lines = [ln.strip() for ln in section.splitlines() if ln.strip().startswith("|")]
    assert lines[0] == "| variable | default | what it does |", lines[0]
    assert re.fullmatch(r"\|(\s*:?-+:?\s*\|){3}", lines[1]), lines[1]
    rows = {}
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split(" | ")]
        assert len(cells) == 3, f"not three cells: {ln}"
        name = cells[0].strip("`")
        assert name not in rows, f"{name} twice in README.md's table"
        rows[name] = (cells[1], cells[2])
    return rows


def test_readme_table_matches_the_registry():
    """One row per variable, read (VARIABLES) or only set (SETS), with the registry's default and text
    (`python -m atomflow_bench.envs` prints the table)."""
    want = {n: (v.default_text, v.doc) for n, v in envs.VARIABLES.items()}
    want |= {n: (f"`{s.value}`", s.doc) for n, s in envs.SETS.items() if n not in envs.VARIABLES}
    got = readme_table()
    assert sorted(got) == sorted(want), f"README.md's variables differ: missing {sorted(set(want) - set(got))}, " \
                                        f"not declared {sorted(set(got) - set(want))}"
    for name, (default, doc) in want.items():
        assert got[name][0] == default, f"{name}: README default {got[name][0]!r}, registry {default!r}"
        assert got[name][1] == doc, f"{name}: README text differs from envs.py's"
    assert got == {n: want[n] for n in got}
    table = envs.markdown_table().splitlines()
    assert len(table) == 2 + len(want) and table[0] == "| variable | default | what it does |"


def test_defaults_when_unset_or_empty(monkeypatch):
    for name in envs.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    home = Path.home()
    assert envs.ATOMFLOW_HOME == home / ".cache" / "atomflow-bench"
    assert envs.ATOMFLOW_FORMS is None and envs.ATOMFLOW_KERNELS_DIR is None
    assert envs.ATOMFLOW_KERNEL_DEFINES == () and envs.ATOMFLOW_WHEELHOUSE == ()
    assert envs.ATOMFLOW_PDL is True
    assert envs.CUDA_PATH is None and envs.CUDA_HOME is None
    assert envs.RANK is None and envs.WORLD_SIZE is None and envs.LOCAL_RANK is None
    assert (envs.MASTER_ADDR, envs.MASTER_PORT) == ("127.0.0.1", 29500)
    for name in envs.VARIABLES:  # an empty value is the default
        unset = getattr(envs, name)
        monkeypatch.setenv(name, "")
        assert getattr(envs, name) == unset, name


def test_home_expands_the_tilde_and_is_read_at_access_time(monkeypatch, tmp_path):
    from atomflow_bench.store import store

    monkeypatch.setenv("ATOMFLOW_HOME", "~/elsewhere")
    assert envs.ATOMFLOW_HOME == Path.home() / "elsewhere"
    monkeypatch.setenv("ATOMFLOW_HOME", str(tmp_path))
    assert envs.ATOMFLOW_HOME == tmp_path and store.home() == tmp_path


def test_pdl_is_zero_or_one(monkeypatch):
    monkeypatch.setenv("ATOMFLOW_PDL", "0")
    assert envs.ATOMFLOW_PDL is False
    monkeypatch.setenv("ATOMFLOW_PDL", "1")
    assert envs.ATOMFLOW_PDL is True
    monkeypatch.setenv("ATOMFLOW_PDL", "off")
    with pytest.raises(AtomflowError, match="ATOMFLOW_PDL='off'"):
        envs.ATOMFLOW_PDL


def test_parsers(monkeypatch, tmp_path):
    monkeypatch.setenv("ATOMFLOW_KERNEL_DEFINES", " AF_NO_WAIT=2  GEMV_BULK=0 ")
    assert envs.ATOMFLOW_KERNEL_DEFINES == ("AF_NO_WAIT=2", "GEMV_BULK=0")
    monkeypatch.setenv("ATOMFLOW_WHEELHOUSE", os.pathsep.join([str(tmp_path / "a"), "", "~/b"]))
    assert envs.ATOMFLOW_WHEELHOUSE == (tmp_path / "a", Path.home() / "b")
    monkeypatch.setenv("ATOMFLOW_FORMS", "  split:ring/l2=0 ")
    assert envs.ATOMFLOW_FORMS == "split:ring/l2=0"
    monkeypatch.setenv("ATOMFLOW_FORMS", "   ")
    assert envs.ATOMFLOW_FORMS is None
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert envs.CUDA_HOME == tmp_path
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("MASTER_PORT", "1234")
    assert (envs.RANK, envs.MASTER_PORT) == (3, 1234)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(AtomflowError, match="WORLD_SIZE='two': not an integer"):
        envs.WORLD_SIZE
    with pytest.raises(AttributeError):
        envs.ATOMFLOW_NOT_A_VARIABLE


def test_what_the_package_sets(monkeypatch):
    for k in ("NCCL_NVLS_ENABLE", *envs.VARIABLES):
        monkeypatch.delenv(k, raising=False)
    envs.set_default("NCCL_NVLS_ENABLE")
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")  # the user's value wins
    envs.set_default("NCCL_NVLS_ENABLE")
    assert os.environ["NCCL_NVLS_ENABLE"] == "1"
    env = envs.rank_environment(1, 2, 4321)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "ATOMFLOW_TP_PORT")} == \
        {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "ATOMFLOW_TP_PORT": "4321"}
    assert env["NCCL_NVLS_ENABLE"] == "1" and "RANK" not in os.environ
    assert set(envs.SETS) - set(envs.VARIABLES) == {"NCCL_NVLS_ENABLE"}
    # what a rank reads back is what its launcher set
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "ATOMFLOW_TP_PORT"):
        monkeypatch.setenv(k, env[k])
    assert (envs.RANK, envs.WORLD_SIZE, envs.LOCAL_RANK, envs.MASTER_ADDR, envs.ATOMFLOW_TP_PORT) == \
        (1, 2, 1, "127.0.0.1", 4321)


def test_a_bad_launcher_variable_is_one_line(tmp_path):
    """A non-integer RANK / WORLD_SIZE stops the CLI with one line naming the variable, before any command runs."""
    env = {k: v for k, v in os.environ.items() if k not in envs.VARIABLES}
    env |= {"RANK": "first", "WORLD_SIZE": "2", "ATOMFLOW_HOME": str(tmp_path),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "atomflow_bench.cli", "models"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == "", (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stderr.strip() == "error: RANK='first': not an integer", proc.stderr
