"""Tensor parallel without GPUs (CPU): the usage errors of --tp / --allreduce (one line, exit 2, before anything needs a
GPU), the launcher's exit-code rule (tests start real processes: `python -m atomflow_bench.cli` per rank), the layout
every rank exports, the sum's block plan, and `compare` refusing records of another tensor-parallel degree."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from atomflow_bench.cli import main
from atomflow_bench.errors import AtomflowError
from atomflow_bench.gpu.tp import group as comm
from atomflow_bench.gpu.tp import sums as tp_comm


@pytest.mark.parametrize("argv, word", [
    (["run", "--allreduce", "peer"], "--allreduce needs --tp 2"),
    (["run", "--tp", "2", "--peers"], "--peers runs on one GPU"),
    (["run", "--tp", "2", "--retune"], "not tuned"),
    (["profile", "--allreduce", "nccl"], "--allreduce needs --tp 2"),
    (["validate", "--tp", "2", "--quality"], "--tp validates the GPU engine"),
    (["validate", "--tp", "2", "--backend", "numpy"], "--tp validates the GPU engine"),
    (["run", "--tp", "9"], "9 is not in the range"),
    (["run", "--tp", "2", "--tp-timeout", "0"], "'--tp-timeout': 0 is not a positive number of seconds"),
    (["profile", "--tp", "2", "--tp-timeout", "-5"], "'--tp-timeout': -5 is not a positive number of seconds"),
    (["validate", "--tp", "2", "--tp-timeout", "nan"], "'--tp-timeout': nan is not a positive number of seconds"),
    (["run", "--tp", "2", "--tp-timeout", "inf"], "'--tp-timeout': inf is not a positive number of seconds"),
    (["run", "--tp", "2", "--tp-timeout", "soon"], "'soon' is not a valid float"),
    (["run", "--tp-timeout", "30"], "--tp-timeout needs --tp 2 or more"),
    (["sweep", "--tp", "1", "--tp-timeout", "30"], "--tp-timeout needs --tp 2 or more"),
])
def test_usage_errors_before_the_gpu(argv, word, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert word in " ".join(err.split())
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err


def test_tp_timeout_goes_to_the_ranks_this_command_starts(tmp_path, monkeypatch, capsys):
    """`--tp N` starts its ranks with its own command line: --tp-timeout is on each rank's (parsed there, as under a
    launcher; tests/test_tp_launch.py runs such a rank)."""
    from types import SimpleNamespace

    from atomflow_bench.gpu import device
    from atomflow_bench.gpu.tp import context

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID",
                 "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ATOMFLOW_HOME", str(tmp_path))
    two_gpus = SimpleNamespace(cuda=SimpleNamespace(runtime=SimpleNamespace(getDeviceCount=lambda: 2)))
    monkeypatch.setattr(device, "require_gpu", lambda: two_gpus)
    monkeypatch.setattr(context, "require_gpu", lambda: two_gpus)
    started = []
    monkeypatch.setattr(context, "launch", lambda n, argv, gpus: started.append((n, argv)) or 0)
    argv = ["profile", "llama-3.2-1b", "--tp", "2", "--tp-timeout", "7.5"]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0 and started == [(2, argv)]


def test_a_sweep_cell_of_tp_2_passes_tp_timeout_on(monkeypatch):
    import subprocess

    from atomflow_bench.gpu.tp.context import open_cell

    seen = []
    monkeypatch.setattr(subprocess, "run", lambda argv, **kw: seen.append(argv) or subprocess.CompletedProcess(
        argv, 1, "", "error: stopped here\n"))
    with pytest.raises(AtomflowError, match="stopped here"):
        open_cell("llama-3.1-8b", 2, tp_timeout=7.5).measure("fp16", 128, 8, 1)
    assert seen[0][seen[0].index("--tp-timeout") + 1] == "7.5"
    with pytest.raises(AtomflowError):
        open_cell("llama-3.1-8b", 2).measure("fp16", 128, 8, 1)
    assert "--tp-timeout" not in seen[1]


def test_launcher_exit_codes(tmp_path, monkeypatch):
    monkeypatch.setenv("ATOMFLOW_HOME", str(tmp_path))
    assert comm.launch(2, ["models", "--format", "json"], gpus=2) == 0
    assert comm.launch(2, ["run", "--no-such-option"], gpus=2) == 2  # every rank fails: the first code
    with pytest.raises(AtomflowError, match="needs 4 GPUs on this host, 2 visible"):
        comm.launch(4, ["models"], gpus=2)


def test_exported_layout_is_aligned_and_disjoint():
    lay = tp_comm.exported_layout(8192, 528, 4)
    spans = sorted((off, off + int(np.prod(shape)) * dt.itemsize)
                   for name, (off, shape, dt) in lay.items() if name != "_bytes")
    assert all(a % 256 == 0 for a, _ in spans)
    assert all(b1 <= a2 for (_, b1), (a2, _) in zip(spans, spans[1:]))
    assert lay["_bytes"][0] == spans[-1][1]
    assert lay["flags"][1] == (tp_comm.TP_MAX_RANKS,)
    assert all(lay[k][1] == (4, 8192) and lay[k][2] == np.uint64 for k in ("gemv0", "gemv1", "sum0", "sum1"))


@pytest.mark.parametrize("hidden, blocks", [(256, 1), (576, 3), (3072, 12), (4096, 16), (8192, 32), (16384, 64)])
def test_sum_blocks(hidden, blocks):
    assert tp_comm.sum_blocks(hidden) == blocks


def test_sum_blocks_refuses():
    with pytest.raises(AtomflowError, match="at most 64"):
        tp_comm.sum_blocks(16384 + 256)


def test_compare_refuses_another_tp(tmp_path, capsys):
    from pathlib import Path

    ref = Path(__file__).resolve().parents[1] / "results" / "reference" / "llama-3.2-3b-fp16-ctx128.json"
    base = json.loads(ref.read_text())
    new = copy.deepcopy(base)
    new["tp"] = {"n": 2}
    (tmp_path / "a.json").write_text(json.dumps(base))
    (tmp_path / "b.json").write_text(json.dumps(new))
    with pytest.raises(SystemExit) as e:
        main(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert e.value.code == 2
    assert "tp.n differs" in capsys.readouterr().err
    (tmp_path / "c.json").write_text(json.dumps(new))
    try:  # the same tp: compared (no refusal)
        code = main(["compare", str(tmp_path / "b.json"), str(tmp_path / "c.json")])
    except SystemExit as e:
        code = e.code
    assert code in (0, None)
    assert "ok (TPOT +0.00%" in capsys.readouterr().out


@pytest.mark.parametrize("fmt, cc, want", [("fp8", 90, "short:ws/l2=8/wo-pre=2;split:ws/l2=8/wo-pre=2"),
                                           ("fp16", 90, "short:ws/l2=8;split:ws/l2=8"),
                                           ("fp8", 89, "short:ring/l2=8;split:ring/l2=8")])
def test_tp_default_forms(fmt, cc, want):
    """W8A16 under tensor parallel takes the measured ws/l2=8/wo-pre=2 form on sm_90+; fp16 and sm_89 keep the
    engine's defaults."""
    from atomflow_bench.gpu.forms import Forms, tp_defaults

    base = "short:ws/l2=8;split:ws/l2=8" if fmt == "fp16" else "short:ring/l2=8;split:ring/l2=8"
    assert tp_defaults(Forms.parse(base), fmt, cc).text == want


def test_hold_position_sets_advance_to_zero_on_the_lm_head_and_the_combine_only():
    """step.hold_position: the lm_head's and the tp combine's last argument (advance) becomes 0; other launches and
    collectives pass unchanged; the original launches are not modified."""
    import numpy as np

    from atomflow_bench.gpu.tp.group import HostOp
    from atomflow_bench.gpu.launch import Launch, i32
    from atomflow_bench.gpu.step import hold_position

    lm = Launch(None, "gemv_fp16_f32_argmax", (4,), (256,), (np.uint64(1), i32(7), i32(1)))
    comb = Launch(None, "tp_argmax_combine", (1,), (32,), (np.uint64(2), i32(3), i32(1)))
    other = Launch(None, "gemv_fp16_partial", (8,), (256,), (np.uint64(3), i32(1)))
    op = HostOp(lambda: None, "nccl_allreduce", "nccl allreduce")
    held = hold_position([lm, other, op, comb])
    assert [int(h.args[-1]) for h in (held[0], held[3])] == [0, 0]
    assert held[0].args[:-1] == lm.args[:-1] and held[0].name == lm.name and held[0].grid == lm.grid
    assert held[1] is other and held[2] is op
    assert int(lm.args[-1]) == 1 and int(comb.args[-1]) == 1
