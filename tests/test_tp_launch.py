"""Tensor-parallel ranks under launchers, with real processes and no GPU: the rendezvous ends in one line naming the
rank and the cause within ATOMFLOW_TP_TIMEOUT (nobody serves the port, another program holds it, a rank missing);
torchrun's, mpirun's and srun's variables are read and torchrun's own store is left alone; a rank killed mid-run
ends the other ranks and the `--tp N` launcher within seconds, non-zero, naming the rank."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from atomflow_bench import envs
from atomflow_bench.gpu.tp import group

ROOT = Path(__file__).resolve().parents[1]
JOIN = [sys.executable, str(ROOT / "tests" / "tp_join.py"), "2"]  # a rank's join as `run --tp 2` does it
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ATOMFLOW_TP_PORT",
               "ATOMFLOW_TP_TIMEOUT", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
               "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


def clean_env(home, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(PYTHONPATH=str(ROOT), ATOMFLOW_HOME=str(home), CUDA_VISIBLE_DEVICES="")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def start(argv, env) -> subprocess.Popen:
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def finish(p: subprocess.Popen, within: float) -> tuple[int, str, float]:
    """(exit code, stderr, seconds) of `p`, which must end within `within` seconds (else it is killed: a hang)."""
    t0 = time.monotonic()
    try:
        _, err = p.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        pytest.fail(f"still running after {within} s (hangs)")
    return p.returncode, err, time.monotonic() - t0


def error_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.strip()]


class Squatter:
    """A program that holds a port and accepts connections without ever answering (as torchrun's agent store does for
    a stranger's bytes)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.conns = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                self.conns.append(self.sock.accept()[0])
            except OSError:
                return

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


# ---- item 1: the rendezvous ends, in one line, within the timeout --------------------------------------------------
def test_rank_without_rank_0_ends_within_the_timeout(tmp_path):
    port = group.free_port()
    code, err, secs = finish(start(JOIN, clean_env(tmp_path, RANK=1, WORLD_SIZE=2, ATOMFLOW_TP_PORT=port,
                                                  ATOMFLOW_TP_TIMEOUT=2)), 30)
    lines = error_lines(err)
    assert code == 1 and len(lines) == 1, err
    assert lines[0].startswith(f"error: rank 1: rendezvous: no rank 0 answered at 127.0.0.1:{port} within 2 s"), err
    assert "connection refused" in lines[0] and 1.5 < secs < 20


# a rank's command line as a launcher gives it (torchrun runs the same command once per rank), on a CPU machine: the
# command's GPU check passes so that the rank reaches its rendezvous, where it ends
RANK_CLI = [sys.executable, "-c", "import atomflow_bench.gpu.device as d; d.require_gpu = lambda: None; "
                                  "from atomflow_bench.cli import main; main()"]


@pytest.mark.parametrize("option, env, bound", [(["--tp-timeout", "1.5"], "60", "1.5"),  # the option, not the env
                                                ([], "1", "1")])                              # no option: the env
def test_tp_timeout_bounds_a_ranks_rendezvous(tmp_path, option, env, bound):
    port = group.free_port()
    argv = [*RANK_CLI, "profile", "llama-3.2-1b", "--tp", "2", *option]
    code, err, secs = finish(start(argv, clean_env(tmp_path, RANK=1, WORLD_SIZE=2, ATOMFLOW_TP_PORT=port,
                                                  ATOMFLOW_TP_TIMEOUT=env)), 30)
    lines = error_lines(err)
    assert code == 1 and len(lines) == 1, err
    assert lines[0].startswith(f"error: rank 1: rendezvous: no rank 0 answered at 127.0.0.1:{port} within {bound} s")
    assert "--tp-timeout or ATOMFLOW_TP_TIMEOUT sets the wait" in lines[0] and float(bound) <= secs < 20


def test_rank_0_alone_names_the_missing_ranks(tmp_path):
    code, err, secs = finish(start(JOIN, clean_env(tmp_path, RANK=0, WORLD_SIZE=2, ATOMFLOW_TP_PORT=group.free_port(),
                                                  ATOMFLOW_TP_TIMEOUT=2)), 30)
    lines = error_lines(err)
    assert code == 1 and len(lines) == 1, err
    assert lines[0].startswith("error: rank 0: rendezvous on 127.0.0.1:") and "rank 1 did not join within 2 s" in err


def test_a_port_another_program_holds(tmp_path):
    """The issue's hang: the port belongs to another program (torchrun's store). Rank 0 cannot serve there; rank 1
    reaches a stranger that never answers: both end in one line, well within the timeout."""
    sq = Squatter()
    try:
        env = dict(WORLD_SIZE=2, ATOMFLOW_TP_PORT=sq.port, ATOMFLOW_TP_TIMEOUT=60)
        r0, r1 = (start(JOIN, clean_env(tmp_path, RANK=r, **env)) for r in (0, 1))
        (c0, e0, s0), (c1, e1, s1) = finish(r0, 30), finish(r1, 30)
    finally:
        sq.close()
    assert c0 == 1 and error_lines(e0) == [f"error: rank 0: cannot serve the ranks' rendezvous on 127.0.0.1:{sq.port}: "
                                           "port in use (set ATOMFLOW_TP_PORT to a free port on every rank)"], e0
    assert c1 == 1 and len(error_lines(e1)) == 1, e1
    assert e1.startswith(f"error: rank 1: rendezvous: 127.0.0.1:{sq.port} answers but is not rank 0's rendezvous")
    assert s0 < 20 and s1 < 20


def test_under_torchrun_the_ranks_meet_beside_its_store(tmp_path):
    """Real torchrun: its agent store holds MASTER_PORT; the ranks meet on the next port and get as far as the GPU
    (none here: exit 3, one line each), none waits on the rendezvous."""
    pytest.importorskip("torch")
    port = group.free_port()
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
            *JOIN[1:]]
    code, err, secs = finish(start(argv, clean_env(tmp_path, ATOMFLOW_TP_TIMEOUT=30)), 120)
    # each rank writes its line in one write; torchrun's agent may pass two ranks' lines on without the first's
    # newline between them, so the lines are found by their prefix wherever they start
    mine = re.findall(r"error: (rank \d+): (.*?)(?=error: rank \d+:|\n|$)", err)
    assert code != 0 and sorted(r for r, _ in mine) == ["rank 0", "rank 1"], err
    assert all("no NVIDIA driver" in t or "no CUDA device" in t for _, t in mine), err
    assert "rendezvous" not in err and secs < 60


def test_under_torchrun_a_rendezvous_on_its_store_ends_at_once(tmp_path):
    """ATOMFLOW_TP_PORT pointed at torchrun's own store: each rank says so in one line, torchrun ends, non-zero."""
    pytest.importorskip("torch")
    port = group.free_port()
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
            *JOIN[1:]]
    code, err, secs = finish(start(argv, clean_env(tmp_path, ATOMFLOW_TP_PORT=port, ATOMFLOW_TP_TIMEOUT=60)), 120)
    assert code != 0, err
    assert f"error: rank 0: cannot serve the ranks' rendezvous on 127.0.0.1:{port}: port in use" in err
    assert secs < 60


@pytest.mark.parametrize("names", [("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
                                   ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")])
def test_mpirun_and_srun_variables(tmp_path, names, monkeypatch):
    """mpirun's and srun's names are read where RANK / WORLD_SIZE / LOCAL_RANK are unset: two processes given only
    those meet (on MASTER_PORT + 1) and stop at the GPU."""
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv(names[0], "1")
    monkeypatch.setenv(names[1], "2")
    monkeypatch.setenv(names[2], "1")
    assert (envs.RANK, envs.WORLD_SIZE, envs.LOCAL_RANK) == (1, 2, 1) and group.joined()
    monkeypatch.setenv("RANK", "0")  # a launcher's own name wins
    assert envs.RANK == 0
    monkeypatch.setenv(names[1], "1")
    monkeypatch.delenv("RANK")
    assert not group.joined()  # one task (srun -n 1): `--tp N` starts its ranks itself
    base = group.free_port()
    ps = [start(JOIN, clean_env(tmp_path, MASTER_PORT=base, ATOMFLOW_TP_TIMEOUT=20,
                               **{names[0]: r, names[1]: 2, names[2]: r})) for r in (0, 1)]
    for r, p in enumerate(ps):
        code, err, _ = finish(p, 60)
        assert code == 3 and error_lines(err)[0].startswith(f"error: rank {r}: "), err
        assert "rendezvous" not in err


def test_the_rendezvous_port(monkeypatch):
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    assert group.rendezvous_port() == 29501 and envs.ATOMFLOW_TP_TIMEOUT == 120
    monkeypatch.setenv("MASTER_PORT", "29544")
    assert group.rendezvous_port() == 29545
    monkeypatch.setenv("ATOMFLOW_TP_PORT", "4000")
    assert group.rendezvous_port() == 4000
    monkeypatch.setenv("ATOMFLOW_TP_TIMEOUT", "-1")
    with pytest.raises(Exception, match="ATOMFLOW_TP_TIMEOUT"):
        envs.ATOMFLOW_TP_TIMEOUT


# ---- item 5: one rank killed mid-run -------------------------------------------------------------------------------
RANK_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    rank = int(os.environ["RANK"])
    if rank == {victim}:
        time.sleep(0.5)
        {death}
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as a rank stuck in a collective that no handler reaches
    time.sleep(600)
""")


@pytest.mark.parametrize("death, want_code, want_line", [
    ("os.kill(os.getpid(), signal.SIGKILL)", 137, "error: rank 1 was killed by SIGKILL; ranks 0, 2 were stopped"),
    ("sys.exit(5)", 5, None),
])
def test_launcher_ends_when_a_rank_dies(tmp_path, death, want_code, want_line, capfd):
    """`--tp 3`'s launcher with ranks that are plain scripts: rank 1 dies, the others would wait forever (and ignore
    SIGTERM). The launcher ends within seconds with the rank's code (128 + the signal), naming a killed rank."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT.format(victim=1, death=death))
    t0 = time.monotonic()
    code = group.launch(3, [], gpus=3, command=[sys.executable, str(script)])
    secs = time.monotonic() - t0
    err = capfd.readouterr().err
    assert code == want_code and secs < group.KILL_AFTER + 5, (code, secs)
    if want_line:
        assert error_lines(err) == [want_line], err
    else:
        assert "error:" not in err  # the rank printed its own line (a script here prints none)


STUCK_AT_EXIT = textwrap.dedent("""
    import os, signal, time
    if int(os.environ["RANK"]) == 1:  # done, then stuck (as a rank hung in a destructor at exit), deaf to SIGTERM
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(600)
""")


def test_launcher_stops_a_rank_stuck_after_another_finished(tmp_path, monkeypatch, capfd):
    """Rank 0 exits 0, rank 1 never exits: the launcher stops it EXIT_GRACE seconds later, exits 1 and says so in
    one line (instead of holding the command forever)."""
    monkeypatch.setattr(group, "EXIT_GRACE", 1.0)
    script = tmp_path / "rank.py"
    script.write_text(STUCK_AT_EXIT)
    t0 = time.monotonic()
    code = group.launch(2, [], gpus=2, command=[sys.executable, str(script)])
    secs = time.monotonic() - t0
    assert code == 1 and 1.0 <= secs < 1.0 + group.KILL_AFTER + 5, (code, secs)
    assert error_lines(capfd.readouterr().err) == ["error: rank 1 did not exit within 1 s of a rank that finished; "
                                                   "stopped"]


def test_a_sigterm_while_the_ranks_start_stops_every_started_rank(tmp_path, monkeypatch):
    """SIGTERM arrives while a rank is being started (here: inside the first Popen call, after the child began): the
    launcher still stops every rank it started and ends by the signal's own handler. Raised there at once, the
    signal's exception would lose the child that Popen had not yet returned, left running on its GPU."""
    from atomflow_bench.errors import Terminated

    started, real = [], subprocess.Popen

    def popen(*args, **kwargs):
        child = real([sys.executable, "-c", "import time; time.sleep(60)"], stdout=subprocess.DEVNULL)
        started.append(child)
        if len(started) == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs at the next bytecode: before Popen returns
            time.sleep(0.2)
        return child

    def stop(signum, frame):
        raise Terminated()

    monkeypatch.setattr(group.subprocess, "Popen", popen)
    old = signal.signal(signal.SIGTERM, stop)
    try:
        with pytest.raises(Terminated):
            group.launch(2, [], gpus=2, command=[sys.executable])
    finally:
        signal.signal(signal.SIGTERM, old)
        for child in started:
            if child.poll() is None:
                child.kill()
                child.wait()
                pytest.fail(f"rank pid {child.pid} was left running")
    assert len(started) == 2 and signal.getsignal(signal.SIGTERM) is old


WATCHED = textwrap.dedent("""
    import os, signal, sys, time
    from atomflow_bench import envs
    from atomflow_bench.gpu.tp import group
    from atomflow_bench.gpu.tp.rendezvous import Rendezvous
    rdv = Rendezvous(envs.RANK, envs.WORLD_SIZE, envs.MASTER_ADDR, group.rendezvous_port(), envs.ATOMFLOW_TP_TIMEOUT)
    assert rdv.share(b"nccl-id" if envs.RANK == 0 else None) == b"nccl-id"
    mode = sys.argv[1]
    if mode == "kill" and envs.RANK == {victim}:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "kill":
        time.sleep(600)  # as a rank waiting in a collective for its dead peer
    time.sleep(0.3 * envs.RANK)  # done at different times: an exit after bye is no failure
    rdv.bye()
    time.sleep(0.3 * (2 - envs.RANK))
""")


@pytest.mark.parametrize("victim", [1, 0])
def test_under_an_external_launcher_the_peers_of_a_killed_rank_end(tmp_path, victim):
    """Ranks started by a launcher that does not stop them (srun without --kill-on-bad-exit): a killed rank's peers,
    blocked forever, end by themselves within seconds, non-zero, each naming the rank."""
    script = tmp_path / "watched.py"
    script.write_text(WATCHED.format(victim=victim))
    port = group.free_port()
    ps = {r: start([sys.executable, str(script), "kill"], clean_env(tmp_path, RANK=r, WORLD_SIZE=3,
                                                                    ATOMFLOW_TP_PORT=port, ATOMFLOW_TP_TIMEOUT=20))
          for r in range(3)}
    for r, p in ps.items():
        code, err, secs = finish(p, 15)
        if r == victim:
            assert code == -signal.SIGKILL
            continue
        seen = "; rank 0 saw it" if r and victim else ""
        assert code == 1 and error_lines(err) == [f"error: rank {r}: rank {victim} left the group before the run ended "
                                                  f"(it exited or was killed{seen}); this rank stops too"], err


def test_ranks_that_say_bye_exit_cleanly(tmp_path):
    script = tmp_path / "watched.py"
    script.write_text(WATCHED.format(victim=-1))
    port = group.free_port()
    ps = [start([sys.executable, str(script), "bye"], clean_env(tmp_path, RANK=r, WORLD_SIZE=3, ATOMFLOW_TP_PORT=port,
                                                               ATOMFLOW_TP_TIMEOUT=20)) for r in range(3)]
    for p in ps:
        code, err, _ = finish(p, 30)
        assert code == 0 and err == "", err


# ---- a rank's teardown order ----------------------------------------------------------------------------------------
class _Forms:
    text = "fake"


class _Engine:
    """Stands in for gpu/engine.py Engine: records its close in the shared log."""

    def __init__(self, *a, log, **k):
        self.log, self.forms = log, _Forms()

    def close(self):
        self.log.append("engine.close")


class _Group:
    rank = 0

    def __init__(self, log):
        self.log = log

    def close(self, ok=True):
        self.log.append(f"group.close(ok={ok})")


@pytest.mark.parametrize("fails", [False, True])
def test_a_rank_releases_its_engines_graphs_before_its_group_closes(monkeypatch, fails):
    """Under tensor parallel the engines' CUDA graphs hold captured NCCL work: TpContext releases every engine it
    made (Engine.close) before the group closes, whether the command succeeded or raised."""
    from atomflow_bench.gpu.tp import context

    log = []
    monkeypatch.setattr(context, "Engine", lambda *a, **k: _Engine(*a, log=log, **k))
    monkeypatch.setattr(context, "choose_forms", lambda given: (None, None))
    ctx = context.TpContext("m", None, "synthetic", group=_Group(log))
    with pytest.raises(RuntimeError) if fails else contextlib.nullcontext():
        with ctx:
            ctx.engine("fp16", 64)
            ctx.engine("fp8", 64)
            if fails:
                raise RuntimeError("a failing command")
    assert log == ["engine.close", "engine.close", f"group.close(ok={not fails})"]
    assert context.TpContext("m", None, "x", group=_Group([]))._engines == ()  # not shared between contexts
