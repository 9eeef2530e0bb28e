"""Other processes on the GPU (CPU): `run` looks at NVML's running compute processes before and after its timings and
says in its record and its table when another process held the GPU (its timings are then not clean), or that it could
not look (no pynvml, NVML refusing). NVML here is a fake with the calls pynvml makes; our own ranks are real
processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from helpers_runs import make_run

from atomflow_bench.measure import power
from atomflow_bench.measure import run_record
from atomflow_bench.output import render

BUS = "0000:3B:00.0"
GIB = 2**30


class FakeNvml:
    """pynvml's calls `other_gpu_processes` makes, over a fixed list of (pid, used bytes, name) on one bus id."""

    def __init__(self, procs, fail=None):
        self.procs, self.fail, self.open = procs, fail, 0

    def nvmlInit(self):
        if self.fail:
            raise RuntimeError(self.fail)
        self.open += 1

    def nvmlShutdown(self):
        self.open -= 1

    def nvmlDeviceGetHandleByPciBusId(self, bus):
        assert bus == BUS.encode()
        return "handle"

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used, _ in self.procs]

    def nvmlSystemGetProcessName(self, pid):
        name = {pid: name for pid, _, name in self.procs}[pid]
        if name is None:
            raise RuntimeError("NVML_ERROR_NO_PERMISSION")
        return name.encode()


def test_other_processes_are_found_and_ours_are_not():
    nvml = FakeNvml([(os.getpid(), GIB, "python"), (4242, GIB, "launcher"), (12345, 2 * GIB, "vllm"),
                     (777, None, None)])
    s = power.other_gpu_processes(BUS, own={4242}, nvml=nvml)
    assert s == {"checked": True, "processes": [{"pid": 777, "name": None, "used_bytes": None},
                                                {"pid": 12345, "name": "vllm", "used_bytes": 2 * GIB}]}
    assert nvml.open == 0, "NVML left initialised"


def test_a_look_before_and_one_after_are_merged():
    me = (os.getpid(), GIB, "python")
    before = power.other_gpu_processes(BUS, nvml=FakeNvml([me, (12345, GIB, "vllm")]))
    after = power.other_gpu_processes(BUS, seen=before, nvml=FakeNvml([me, (555, GIB, "trainer")]))
    assert [p["pid"] for p in after["processes"]] == [555, 12345]
    clean = power.other_gpu_processes(BUS, nvml=FakeNvml([(os.getpid(), GIB, "python")]))
    assert clean == {"checked": True, "processes": []}
    assert power.others_count(after) == 2 and power.others_count(clean) == 0


def test_host_pids_in_a_container():
    """NVML lists host pids: this process is not there by its own pid, so one of the entries is this run."""
    alone = power.other_gpu_processes(BUS, nvml=FakeNvml([(900001, GIB, None)]))
    assert alone["foreign_pids"] and power.others_count(alone) == 0
    assert power.sharing_text(alone).startswith("none")
    shared = power.other_gpu_processes(BUS, nvml=FakeNvml([(900001, GIB, None), (900002, 3 * GIB, None)]))
    assert power.others_count(shared) == 1
    assert "1 other process(es)" in power.sharing_text(shared) and "one of them this run" in power.sharing_text(shared)


def test_not_checked_says_why(monkeypatch):
    refused = power.other_gpu_processes(BUS, nvml=FakeNvml([], fail="NVML_ERROR_DRIVER_NOT_LOADED"))
    assert refused["checked"] is False and "NVML refused" in refused["reason"]

    def no_pynvml():
        raise ImportError("No module named 'pynvml'")

    monkeypatch.setattr(power, "import_pynvml", no_pynvml)
    s = power.other_gpu_processes(BUS)
    assert s["checked"] is False and "pynvml is not importable" in s["reason"]


def _row(rec, name):
    tab = run_record.run_table(rec)
    rows = {r[0]: r[1] for r in tab.rows}
    return rows.get(name)


def test_the_record_and_the_table_say_it(capsys):
    rec = make_run(1.0)
    rec.update({"vram_bytes": {"weights": GIB, "kv": 1 << 20, "activations": 1 << 20, "scratch": 1 << 20,
                               "total": GIB + (3 << 20)}, "load": {"seconds": 1.0}, "launches_per_step": 5})
    rec["other_gpu_processes"] = power.other_gpu_processes(BUS, nvml=FakeNvml([(os.getpid(), GIB, "python"),
                                                                              (12345, 2 * GIB, "vllm")]))
    text = _row(rec, "other GPU processes")
    assert "1 other process(es)" in text and "pid 12345 vllm 2.00 GiB" in text and "not clean" in text
    render(run_record.run_table(rec), "json", None)
    out = capsys.readouterr().out
    assert "pid 12345" in out
    rec["other_gpu_processes"] = {"checked": True, "processes": []}
    assert _row(rec, "other GPU processes").startswith("none")
    rec["other_gpu_processes"] = {"checked": False, "reason": "pynvml is not importable (x)"}
    assert _row(rec, "other GPU processes") == "not checked: pynvml is not importable (x)"
    del rec["other_gpu_processes"]  # an older record
    assert _row(rec, "other GPU processes") is None


SIBLINGS = """
import os, subprocess, sys, time
sib = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
env = dict(os.environ, WORLD_SIZE="2", RANK="0")
code = "import json; from atomflow_bench.measure.power import our_pids; print(json.dumps(sorted(our_pids())))"
rank = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
sib.kill(); sib.wait()
print(json.dumps({"parent": os.getpid(), "sibling": sib.pid, "out": rank.stdout, "err": rank.stderr}))
""".replace("import os,", "import json, os,")


def test_a_ranks_siblings_and_launcher_are_ours():
    """A launcher with two children: the rank (WORLD_SIZE=2) counts its sibling and its launcher as its own."""
    p = subprocess.run([sys.executable, "-c", SIBLINGS], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    pids = set(json.loads(got["out"])) if got["out"] else set()
    assert {got["parent"], got["sibling"]} <= pids, got
