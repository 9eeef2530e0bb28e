"""Every environment variable atomflow-bench reads, declared once: its name, its default, its parser and what it does.

    from atomflow_bench import envs
    envs.ATOMFLOW_HOME          # a Path, read from os.environ now

Reading `envs.NAME` parses the environment at that moment (module `__getattr__`), so a test that monkeypatches a
variable sees it, and this module is the only reader of os.environ in the package (tests/test_envs.py keeps it so;
README.md's `## Environment variables` table is checked against `VARIABLES` and `SETS`). An empty value counts as unset.
A value that does not parse is an `AtomflowError` naming the variable (one line from the CLI).

`SETS` lists what the package writes into the environment: `set_default` for its own process, `rank_environment`
for each rank that `--tp N` starts.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .errors import AtomflowError


def _path(text: str) -> Path:
    return Path(text).expanduser()


def _paths(text: str) -> tuple[Path, ...]:
    return tuple(Path(d).expanduser() for d in text.split(os.pathsep) if d)


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


def _text(text: str) -> str | None:
    return text.strip() or None


def _switch(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError("not 0 or 1")
    return text == "1"


def _int(text: str) -> int:
    if not text.strip().lstrip("-").isdigit():
        raise ValueError("not an integer")
    return int(text)


def _seconds(text: str) -> float:
    v = float(text)
    if not v > 0 or v == float("inf"):
        raise ValueError("not a positive number of seconds")
    return v


@dataclass(frozen=True)
class EnvVar:
    """One variable: `default` is the text used when it is unset or empty (None: no value, `envs.NAME` is None);
    `shown` is the README's default column where the default is not one text (the code decides)."""
    default: str | None
    parse: Callable[[str], Any]
    doc: str
    shown: str | None = None
    also: tuple[str, ...] = ()  # other launchers' names for it (mpirun's, srun's), read in order when it is unset

    @property
    def default_text(self) -> str:
        """The README's default column for this variable."""
        if self.shown:
            return self.shown
        return f"`{self.default}`" if self.default else "unset"


VARIABLES: dict[str, EnvVar] = {
    "ATOMFLOW_HOME": EnvVar(
        "~/.cache/atomflow-bench", _path,
        "root of everything stored: `models/`, `tuning/`, `wheels/`, validation truth (`~` is expanded)"),
    "ATOMFLOW_FORMS": EnvVar(
        None, _text,
        "the launch forms a command uses when `--forms` is not given, e.g. `short:ws-pre2/l2=8;split:ring/l2=0`"),
    "ATOMFLOW_KERNEL_DEFINES": EnvVar(
        "", _words,
        "the kernels' -D macros as `NAME=V ...`: the portable forms (`ATT_TMA`, `GEMV_BULK`) and the timing "
        "instruments (`AF_NO_WAIT`, `AF_NO_SCALES`, `AF_TIMELINE`); no other name is accepted"),
    "ATOMFLOW_KERNELS_DIR": EnvVar(
        None, _path,
        "the `.cu` sources NVRTC compiles",
        shown="the checkout's `kernels_cu/`, else the copy installed in the package"),
    "ATOMFLOW_PDL": EnvVar(
        "1", _switch,
        "programmatic dependent launch on sm_90+ (`0`: off, for an A/B; `Engine(pdl=)` wins)"),
    "ATOMFLOW_WHEELHOUSE": EnvVar(
        "", _paths,
        "directories (`os.pathsep`-separated) searched for pinned wheels before PyPI, for machines without network"),
    "CUPY_CACHE_DIR": EnvVar(
        "~/.cupy/kernel_cache", _path,
        "CuPy's compiled-kernel cache; the sm_90a cubins (`*_sm90a.cu`, built by NVRTC directly) are kept there too"),
    "CUDA_PATH": EnvVar(
        None, _path,
        "a CUDA toolkit whose `include/` NVRTC gets (`cuda_fp16.h`, `cuda_fp8.h`); tried before CUDA_HOME, "
        "`/usr/local/cuda` and the `nvidia-*` wheels"),
    "CUDA_HOME": EnvVar(
        None, _path,
        "as CUDA_PATH, tried after it"),
    "RANK": EnvVar(
        None, _int,
        "this process's rank in a tensor-parallel group; with WORLD_SIZE > 1 the process joins a group (a launcher "
        "started it) instead of starting one; `--tp N` sets it for each rank it starts; unset, mpirun's "
        "`OMPI_COMM_WORLD_RANK` or srun's `SLURM_PROCID` is read",
        also=("OMPI_COMM_WORLD_RANK", "SLURM_PROCID")),
    "WORLD_SIZE": EnvVar(
        None, _int,
        "the number of ranks of the group (set with RANK by a launcher, or by `--tp N` for its ranks); unset, "
        "`OMPI_COMM_WORLD_SIZE` or `SLURM_NTASKS`",
        also=("OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS")),
    "LOCAL_RANK": EnvVar(
        None, _int,
        "the GPU of this host the rank runs on (set by `--tp N` for its ranks); unset, `OMPI_COMM_WORLD_LOCAL_RANK` "
        "or `SLURM_LOCALID`",
        shown="RANK's value", also=("OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")),
    "MASTER_ADDR": EnvVar(
        "127.0.0.1", str,
        "the host of rank 0, which serves the ranks' rendezvous (hands the NCCL id to the other ranks)"),
    "MASTER_PORT": EnvVar(
        "29500", _int,
        "the launcher's port (torchrun's own store holds it); the rendezvous takes the next one"),
    "ATOMFLOW_TP_PORT": EnvVar(
        None, _int,
        "the port of rank 0's rendezvous (`--tp N` sets a free port for its ranks)",
        shown="MASTER_PORT + 1"),
    "ATOMFLOW_TP_TIMEOUT": EnvVar(
        "120", _seconds,
        "seconds a rank waits for the rendezvous (every rank joined, the NCCL id, NCCL's communicator) before it "
        "ends with one line naming the cause; a command's `--tp-timeout` overrides it"),
}


@dataclass(frozen=True)
class EnvSet:
    """A variable the package writes: `value` (None: it differs per rank), and when and why."""
    value: str | None
    doc: str


# What the package sets. NCCL_NVLS_ENABLE with `set_default` (a value the user set wins); the launcher's variables in
# the environment of each rank `--tp N` starts (`rank_environment`), which the ranks then read through VARIABLES.
SETS: dict[str, EnvSet] = {
    "NCCL_NVLS_ENABLE": EnvSet(
        "0", "set by every tensor-parallel rank and `doctor`'s NCCL check unless already set: NVLink multicast off "
             "(on a shared host it can take the GPUs down)"),
    "RANK": EnvSet(None, "each rank's index"),
    "WORLD_SIZE": EnvSet(None, "N"),
    "LOCAL_RANK": EnvSet(None, "the rank's index: rank r runs on GPU r"),
    "MASTER_ADDR": EnvSet("127.0.0.1", "the ranks share this host"),
    "ATOMFLOW_TP_PORT": EnvSet(None, "a free port of this host"),
}


def value(name: str) -> Any:
    """The parsed value of `name` in the environment now (the declared default when unset or empty)."""
    var = VARIABLES[name]
    name = next((n for n in (name, *var.also) if os.environ.get(n)), name)
    text = os.environ.get(name) or var.default
    if not text:
        return None if var.default is None else var.parse(text)
    try:
        return var.parse(text)
    except ValueError as e:
        raise AtomflowError(f"{name}={text!r}: {e}") from None


def set_default(name: str) -> None:
    """Set `name` to the value SETS declares unless the environment already has it."""
    os.environ.setdefault(name, SETS[name].value)


def rank_environment(rank: int, size: int, port: int) -> dict[str, str]:
    """This process's environment plus the launcher's variables for rank `rank` of `size` on this host."""
    return dict(os.environ, RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank),
                MASTER_ADDR=SETS["MASTER_ADDR"].value, ATOMFLOW_TP_PORT=str(port))


def markdown_table() -> str:
    """README.md's table of variables: those read, then those only set (`python -m atomflow_bench.envs` prints it)."""
    rows = ["| variable | default | what it does |", "|---|---|---|"]
    rows += [f"| `{name}` | {var.default_text} | {var.doc} |" for name, var in VARIABLES.items()]
    rows += [f"| `{name}` | `{s.value}` | {s.doc} |" for name, s in SETS.items() if name not in VARIABLES]
    return "\n".join(rows)


def __getattr__(name: str) -> Any:
    if name in VARIABLES:
        return value(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *VARIABLES])


if __name__ == "__main__":
    print(markdown_table())
