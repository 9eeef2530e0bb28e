"""NVRTC: the CUDA kernels compiled from `kernels_cu/*.cu` through CuPy, one RawModule per file, on first use.

Each `.cu` file is one op (see its header). Every op module (gpu/ops/*.py) declares the kernels it launches and the
.cu that defines each (its KERNELS); `KernelLib` compiles a file the first time one of its kernels is asked for (a
step build asks only for the kernels it launches, so only their files are compiled), for the device's own
architecture, and CuPy's on-disk cache (~/.cupy/kernel_cache, keyed by source + options + arch) makes a second
process skip NVRTC. Local `#include "x.cuh"` lines are inlined here so that the cache key covers the headers too.

A source named `NAME_sm90a.cu` uses features of one architecture only (Hopper's wgmma needs the arch-specific
target sm_90a, which CuPy's RawModule does not pass): it is compiled by NVRTC for that target and its cubin, cached
beside CuPy's (keyed by source, options and NVRTC version), loaded as a module. Its op module launches it only on
that architecture (`file_arch`).

The -D macros a KernelLib compiles with are only what the kernels read: the portable forms for GPUs without bulk
copies (`ATT_TMA`, which sm_90+ sets to 1 here, and `GEMV_BULK`) and the timing instruments (`INSTRUMENTS`), from
ATOMFLOW_KERNEL_DEFINES="NAME=V ..." or the caller. Launch policy (which forms a step runs) is not a -D: it is a
`forms.Forms` value handed to the step builder.
"""
from __future__ import annotations

import hashlib
import os
import re
import sys
from pathlib import Path

from .. import envs
from ..errors import AtomflowError


def find_kernels_dir() -> Path:
    """The kernel sources: $ATOMFLOW_KERNELS_DIR when set; else the checkout's kernels_cu/ when running from a
    source tree or an editable install (`pip install -e .`: the sources stay at the repository root, where scripts,
    tests and edits use them); else the copy a wheel installs inside the package (pyproject maps kernels_cu/ to
    the package `atomflow_bench.kernels_cu` as package data, since a wheel carries nothing outside its packages)."""
    if envs.ATOMFLOW_KERNELS_DIR:
        return envs.ATOMFLOW_KERNELS_DIR
    root = Path(__file__).resolve().parents[2]  # the repository root in a checkout; site-packages when installed
    if (root / "pyproject.toml").is_file() and (root / "kernels_cu").is_dir():
        return root / "kernels_cu"
    from importlib.resources import files

    return Path(str(files("atomflow_bench") / "kernels_cu"))


KERNELS_DIR = find_kernels_dir()
_ARCH_FILE = re.compile(r"_sm_?(\d+a)\.cu$")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)


def expand_source(path: Path, seen: set | None = None) -> str:
    """The source of `path` with local quoted includes inlined (each header once)."""
    seen = set() if seen is None else seen
    text = path.read_text()

    def repl(m):
        inc = (path.parent / m.group(1)).resolve()
        if inc in seen:
            return ""
        seen.add(inc)
        return expand_source(inc, seen)

    return _INCLUDE.sub(repl, text)


def file_arch(name: str) -> str | None:
    """The one architecture a source is built for ("sm_90a" for `*_sm90a.cu`), or None: the device's own."""
    m = _ARCH_FILE.search(name)
    return f"sm_{m.group(1)}" if m else None


def compile_for_arch(source: str, name: str, options: tuple, arch: str) -> Path:
    """The cubin of `source` for the arch-specific target `arch` by NVRTC, in an on-disk cache beside CuPy's (a second
    process loads it without compiling; RawModule reads the file when a kernel is first asked for, so it stays)."""
    from cupy_backends.cuda.libs import nvrtc  # CuPy's NVRTC binding: only where a kernel is built

    key = hashlib.sha256("\0".join([source, *options, arch, str(nvrtc.getVersion())]).encode()).hexdigest()
    cache = envs.CUPY_CACHE_DIR / f"atomflow_{arch}_{key}.cubin"
    if cache.is_file():
        return cache
    prog = nvrtc.createProgram(source, name, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, [*options, f"-arch={arch}"])
        except Exception as e:  # noqa: BLE001 - the compiler's log says why
            raise AtomflowError(f"{name}: NVRTC for {arch} failed: {nvrtc.getProgramLog(prog)[-2000:]}") from e
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{os.getpid()}.part")
    tmp.write_bytes(cubin)
    os.replace(tmp, cache)  # atomic: a concurrent reader sees the whole cubin or none
    return cache


def cuda_include_dirs() -> list[str]:
    """Directories holding cuda_fp16.h / cuda_fp8.h for NVRTC (toolkit, or the nvidia-* pip wheels)."""
    cands = []
    for toolkit in (envs.CUDA_PATH, envs.CUDA_HOME):
        if toolkit:
            cands.append(toolkit / "include")
    cands += [Path("/usr/local/cuda/include")]
    for sp in sys.path:
        nv = Path(sp) / "nvidia"
        if nv.is_dir():
            cands += sorted(nv.glob("cu*/include")) + sorted(nv.glob("cuda_runtime/include"))
    out = []
    for c in cands:
        if (c / "cuda_fp8.h").is_file() and str(c) not in out:
            out.append(str(c))
    return out


PORTABLE = ("ATT_TMA", "GEMV_BULK")  # forms for GPUs without bulk copies / TMA (0); ATT_TMA is set to 1 on sm_90+
# Timing instruments: with a non-zero value the step computes wrong results on purpose (AF_NO_WAIT, AF_NO_SCALES:
# common.cuh) or records when each block runs (AF_TIMELINE: lab/timeline.py). `run` marks its record with them,
# `compare` refuses such a record and `validate` refuses to start.
INSTRUMENTS = ("AF_NO_WAIT", "AF_NO_SCALES", "AF_TIMELINE")
KERNEL_DEFINES = PORTABLE + INSTRUMENTS


def knob(name: str, default: int, defines: tuple | None = None) -> int:
    """The integer NAME=V of `defines` (default: ATOMFLOW_KERNEL_DEFINES), else `default`."""
    for d in defines if defines is not None else envs.ATOMFLOW_KERNEL_DEFINES:
        if d.startswith(name + "="):
            return int(d.split("=", 1)[1])
    return default


def parse_defines(text: str | tuple) -> tuple:
    """NAME=V words of the kernels' -D macros; refuses a name the kernels do not read (one line)."""
    words = tuple(text.split()) if isinstance(text, str) else tuple(text)
    for w in words:
        name, eq, value = w.partition("=")
        if name not in KERNEL_DEFINES or not eq or not value.lstrip("-").isdigit():
            raise AtomflowError(f"ATOMFLOW_KERNEL_DEFINES: {w!r} is not NAME=<integer> with NAME one of "
                                f"{', '.join(KERNEL_DEFINES)} (launch forms go in --forms / ATOMFLOW_FORMS)")
    return words


def instrument_defines(defines: tuple | None = None) -> list[str]:
    """The NAME=V of `defines` (default, as for `knob`: ATOMFLOW_KERNEL_DEFINES) that switch a wrong-result timing
    instrument on (AF_TIMELINE only records, so it is not one of them)."""
    return [f"{n}={knob(n, 0, defines)}" for n in ("AF_NO_WAIT", "AF_NO_SCALES") if knob(n, 0, defines)]


def arch_defines(cc: int, defines: tuple) -> tuple:
    """ATT_TMA=1 on sm_90+ where the run does not set it: attention.cu stages K/V groups by 2D tensor copies there,
    which measured faster than per-lane copies. The source default (ATT_TMA 0) is the portable form for older GPUs
    and nvcc."""
    if any(d.startswith("ATT_TMA=") for d in defines) or cc < 90:
        return ()
    return ("ATT_TMA=1",)


class KernelLib:
    """Compiled kernels by name, one cupy.RawModule per .cu file, compiled on first use. `kernels`: {.cu file: its
    kernels} of `kernels_dir`, as the modules that launch them declare them (the product's: gpu/ops kernel_lib;
    the lab passes its own)."""

    OPTIONS = ("-std=c++17",)

    def __init__(self, kernels: dict[str, tuple[str, ...]], kernels_dir: Path = KERNELS_DIR,
                 extra_defines: tuple = ()):
        import cupy  # noqa: F401  (fail here, clearly, when CuPy is missing)

        from .device import compute_capability

        self.dir = Path(kernels_dir)
        if not self.dir.is_dir():
            raise AtomflowError(f"kernel sources not found: {self.dir} (set ATOMFLOW_KERNELS_DIR)")
        self._file_of = {name: self.dir / cu for cu, names in kernels.items() for name in names}
        self._modules: dict[Path, object] = {}
        self._kernels: dict[str, object] = {}
        given = parse_defines(envs.ATOMFLOW_KERNEL_DEFINES) + parse_defines(extra_defines)
        self.defines = given + arch_defines(compute_capability(), given)
        self.options = (self.OPTIONS + tuple(f"-D{d}" for d in self.defines)
                        + tuple(f"-I{d}" for d in cuda_include_dirs()))

    def module(self, path: Path):
        import cupy

        if path not in self._modules:
            arch = file_arch(path.name)
            if arch is None:
                self._modules[path] = cupy.RawModule(code=expand_source(path), options=self.options,
                                                     name_expressions=None)
            else:  # RawModule(path=...) loads a cubin: its kernels are RawKernels like the others
                cubin = compile_for_arch(expand_source(path), path.name, self.options, arch)
                self._modules[path] = cupy.RawModule(path=str(cubin))
        return self._modules[path]

    def __getitem__(self, name: str):
        if name not in self._kernels:
            try:
                f = self._file_of[name]
            except KeyError:
                raise KeyError(f"no kernel {name!r} in {self.dir}") from None
            self._kernels[name] = self.module(f).get_function(name)
        return self._kernels[name]

    def declare(self, kernels: dict[str, tuple[str, ...]]) -> None:
        """Add kernels by the .cu that defines them (a wing that plugs its own kernels into the step)."""
        self._file_of.update({name: self.dir / cu for cu, names in kernels.items() for name in names})

    def compiled_files(self) -> list[str]:
        """The .cu files compiled so far (a step build compiles only those whose kernels it launches)."""
        return sorted(p.name for p in self._modules)
