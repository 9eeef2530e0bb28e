"""The built wheel is complete: installed from it (not from this checkout), atomflow-bench finds the kernel sources
and the recorded baselines inside the installed package, the kernels compile, `baseline list` shows them; and an
editable install still uses the checkout's directories.

The wheel is built from a copy of the package's sources in a temporary directory (setuptools' build/ is never
cleaned, so an in-tree build could hide a missing file behind a stale one, and other work in the checkout is left
alone). The fresh venv gets no pip and no access to the checkout: a .pth names this interpreter's site-packages
directories (dependencies, pip, setuptools) as plain paths, so their .pth files, the editable install's finder among
them, are not run. Every command runs outside the repository with ATOMFLOW_KERNELS_DIR unset.
"""
from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
KERNELS = REPO / "kernels_cu"
BASELINES = REPO / "baselines"
NVCC = shutil.which("nvcc")
# what the build needs from the checkout; everything else (results/, .git, build outputs) stays behind
_SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", "dist")
_TOP = ("pyproject.toml", "setup.py", "setup.cfg", "MANIFEST.in", "README.md", "LICENSE", "atomflow_bench",
        "kernels_cu", "baselines")
# reads, inside the environment under test, where the tool resolves its directories
_PROBE = ("import json, atomflow_bench\n"
          "from atomflow_bench.gpu.nvrtc import KERNELS_DIR\n"
          "from atomflow_bench.measure.baselines import DEFAULT_DIR\n"
          "print(json.dumps({'package': atomflow_bench.__file__, 'kernels': str(KERNELS_DIR),"
          " 'baselines': str(DEFAULT_DIR)}))\n")


def _files(directory: Path, patterns) -> dict[str, bytes]:
    """Relative path -> bytes of every file under `directory` matching one of `patterns` (recursively)."""
    return {p.relative_to(directory).as_posix(): p.read_bytes()
            for pat in patterns for p in directory.rglob(pat) if p.is_file() and "__pycache__" not in p.parts}


def _run(cmd, cwd, env, timeout=300) -> subprocess.CompletedProcess:
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def _copy_sources(dest: Path) -> Path:
    dest.mkdir()
    for name in _TOP:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=_SKIP)
        elif src.is_file():
            shutil.copy2(src, dest / name)
    return dest


def _build_isolation() -> list[str]:
    """--no-build-isolation (fast, offline) when this interpreter has setuptools>=64, else pip's isolated build."""
    try:
        import setuptools
    except ImportError:
        return []
    return ["--no-build-isolation"] if int(setuptools.__version__.split(".")[0]) >= 64 else []


@pytest.fixture(scope="module")
def clean_env(tmp_path_factory) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ATOMFLOW_KERNELS_DIR", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")
           and not k.startswith("PIP_")}
    env.update(COLUMNS="400", NO_COLOR="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
               ATOMFLOW_HOME=str(tmp_path_factory.mktemp("atomflow-home")))
    return env


def _venv(path: Path, env: dict) -> Path:
    """A fresh venv seeing this interpreter's site-packages (dependencies, pip, setuptools) as plain paths only."""
    _run([sys.executable, "-m", "venv", "--without-pip", path], cwd=path.parent, env=env)
    py = path / "bin" / "python"
    purelib = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        cwd=path.parent, env=env).stdout.strip())
    dirs = dict.fromkeys([*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                          *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])])
    (purelib / "_parent_site.pth").write_text("".join(f"{d}\n" for d in dirs if Path(d).is_dir()))
    return py


@pytest.fixture(scope="module")
def installed(tmp_path_factory, clean_env):
    """(venv python, venv dir, probe record, cwd) for the wheel built from a copy of the sources, installed."""
    tmp = tmp_path_factory.mktemp("packaging")
    src = _copy_sources(tmp / "src")
    wheels = tmp / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", *_build_isolation(), "-w", wheels, src],
         cwd=tmp, env=clean_env)
    (whl,) = wheels.glob("atomflow_bench-*.whl")
    venv = tmp / "venv"
    py = _venv(venv, clean_env)
    # --ignore-installed: this interpreter's own (editable) atomflow-bench, visible through the .pth, stays untouched
    _run([py, "-m", "pip", "install", "--no-deps", "--ignore-installed", "--no-index", whl], cwd=tmp, env=clean_env)
    cwd = tmp / "elsewhere"
    cwd.mkdir()
    shutil.rmtree(src)  # nothing of the sources is left to fall back on
    probe = json.loads(_run([py, "-c", _PROBE], cwd=cwd, env=clean_env).stdout)
    return py, venv, probe, cwd


def test_wheel_installs_the_package_not_the_checkout(installed):
    py, venv, probe, _ = installed
    package = Path(probe["package"]).resolve().parent
    assert package.is_relative_to(venv.resolve()), f"imported {package}, not the wheel installed in {venv}"
    # every module and data file of the checkout's package (a subpackage missing from pyproject's list fails here)
    ours = _files(REPO / "atomflow_bench", ("*.py", "*.txt"))
    theirs = _files(package, ("*.py", "*.txt"))
    assert sorted(set(ours) - set(theirs)) == [], "missing from the wheel (add new subpackages to pyproject.toml)"


def test_wheel_ships_no_lab_code(installed):
    """The lab (lab/: probes, instruments, the notebook, per-call records) stays in the checkout: no file the wheel
    installed (its RECORD) is the lab's, neither a top-level `lab` package nor one inside atomflow_bench."""
    _, _, probe, _ = installed
    package = Path(probe["package"]).resolve().parent
    (record,) = package.parent.glob("atomflow_bench-*.dist-info/RECORD")
    files = [line.split(",", 1)[0] for line in record.read_text().splitlines() if line]
    assert any(f == "atomflow_bench/kernels_cu/common.cuh" for f in files)  # the RECORD lists the package's files
    lab = [f for f in files if f.startswith("lab/") or "/lab/" in f or "probe_stream" in f or "PERF_NOTES" in f]
    assert lab == [], f"lab code in the wheel: {lab}"
    assert not (package.parent / "lab").exists() and not (package / "lab").exists()


def test_wheel_carries_the_kernel_sources(installed):
    _, _, probe, _ = installed
    package, kernels = Path(probe["package"]).resolve().parent, Path(probe["kernels"]).resolve()
    assert kernels.is_relative_to(package), f"KERNELS_DIR {kernels} is not inside the installed {package}"
    assert kernels.is_dir(), f"KERNELS_DIR {kernels} does not exist"
    ours, theirs = _files(KERNELS, ("*.cu", "*.cuh")), _files(kernels, ("*.cu", "*.cuh"))
    assert ours and not any(n.startswith("lab/") for n in ours)
    assert sorted(theirs) == sorted(ours), "kernel sources in the wheel differ from kernels_cu/"
    assert [n for n in ours if theirs[n] != ours[n]] == [], "kernel sources changed on the way into the wheel"


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH: the installed kernels are not compiled")
def test_installed_kernels_compile(installed, clean_env):
    _, _, probe, cwd = installed
    kernels = Path(probe["kernels"])
    sources = sorted(kernels.rglob("*.cu"))
    assert sources

    def compile_one(src):
        return src, subprocess.run([NVCC, "-arch=sm_90", "-std=c++17", "--ptx", "-I", str(kernels), "-o", os.devnull,
                                    str(src)], cwd=cwd, env=clean_env, capture_output=True, text=True, timeout=600)

    with ThreadPoolExecutor(max_workers=min(len(sources), os.cpu_count() or 1)) as pool:
        failed = [f"{src.relative_to(kernels)}:\n{out.stderr[-2000:]}"
                  for src, out in pool.map(compile_one, sources) if out.returncode != 0]
    assert not failed, "installed kernels do not compile:\n" + "\n".join(failed)


def test_installed_baseline_list(installed, clean_env):
    py, venv, probe, cwd = installed
    ours = _files(BASELINES, ("*.json", "README.md"))
    records = [json.loads(BASELINES.joinpath(n).read_text()) for n in sorted(ours) if n.endswith(".json")]
    assert records, "the repository records no baselines"

    out = _run([venv / "bin" / "atomflow-bench", "baseline", "list"], cwd=cwd, env=clean_env).stdout
    # one row per baseline, on a line of its own, with its model, engine and TPOT as the command prints them (a rich
    # table 400 columns wide or a markdown table alike: the row is one line)
    lines = out.splitlines()
    for rec in records:
        m = rec["metrics"]
        tpot = f"{m['tpot_fit_ms']['intercept']:g} + " if m.get("tpot_fit_ms") else f"{m['tpot_ms']:.3f}"
        cells = (rec["model"], rec["engine"]["name"], tpot)
        row = next((i for i, line in enumerate(lines) if all(c in line for c in cells)), None)
        assert row is not None, f"no row {cells} among the {len(records)} baselines recorded:\n{out}"
        lines[row] = ""  # each baseline its own row

    package, default = Path(probe["package"]).resolve().parent, Path(probe["baselines"]).resolve()
    assert default.is_relative_to(package), f"DEFAULT_DIR {default} is not inside the installed {package}"
    assert _files(default, ("*.json", "README.md")) == ours, "baselines in the wheel differ from baselines/"


def test_editable_install_uses_the_checkout(tmp_path, clean_env):
    """`pip install -e .` (CI, the device): the directories at the repository root, not an installed copy."""
    src = _copy_sources(tmp_path / "src")
    py = _venv(tmp_path / "venv", clean_env)
    _run([py, "-m", "pip", "install", "--no-deps", "--ignore-installed", *_build_isolation(), "-e", src],
         cwd=tmp_path, env=clean_env)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    probe = json.loads(_run([py, "-c", _PROBE], cwd=cwd, env=clean_env).stdout)
    assert Path(probe["package"]).resolve() == (src / "atomflow_bench" / "__init__.py").resolve()
    assert Path(probe["kernels"]).resolve() == (src / "kernels_cu").resolve()
    assert Path(probe["baselines"]).resolve() == (src / "baselines").resolve()
    out = _run([tmp_path / "venv" / "bin" / "atomflow-bench", "baseline", "list"], cwd=cwd, env=clean_env).stdout
    for p in sorted((src / "baselines").glob("*.json")):
        assert json.loads(p.read_text())["engine"]["name"] in out
