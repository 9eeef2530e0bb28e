"""Energy per token (measure/power.py): the bookkeeping with an injected NVML-like reader and a fake clock (not a GPU
claim), the "unavailable" paths, the device lookup by PCI bus id, and the run table's "energy" row."""
from __future__ import annotations

import builtins
import sys
import types

import pytest
from helpers_runs import make_run

from atomflow_bench.measure.power import (COUNTER, SAMPLES, EnergyMeter, Segment, Unavailable, bus_key, integrate,
                                          open_meter, summarize_energy)
from atomflow_bench.output import text

BUS = "0000:3B:00.0"


class Clock:
    """A host clock the test moves by hand."""

    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class FakeReader:
    """NVML-like: an energy counter (mJ) that the test advances, a power reading (mW) it sets."""

    def __init__(self, counter: bool = True):
        self.mj, self.mw = 5_000_000, 400_000
        self.pci_bus_id = BUS
        self.counter_note = None if counter else "no energy counter: NVMLError_NotSupported: Not Supported"
        self.closed = False
        self.fail_power = False

    def energy_mj(self) -> int:
        if self.counter_note:
            raise AssertionError("the meter read a counter it was told is missing")
        return self.mj

    def power_mw(self) -> int:
        if self.fail_power:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return self.mw

    def close(self) -> None:
        self.closed = True


def run_segments(meter, reader, clock, segs):
    """Each (seconds, joules, start W, end W, tokens): start, let time and energy pass, stop."""
    for seconds, joules, w0, w1, tokens in segs:
        reader.mw = w0 * 1000
        meter.start()
        clock.t += seconds
        reader.mj += int(round(joules * 1000))
        reader.mw = w1 * 1000
        meter.stop(tokens, event_ms=seconds * 1e3 - 0.01)


def test_counter_arithmetic_over_the_timed_repeats():
    clock, reader = Clock(), FakeReader()
    m = EnergyMeter(reader, clock=clock, interval_s=None)
    run_segments(m, reader, clock, [(1.2, 480.0, 400, 400, 256)] * 5)  # 5 repeats x 256 tokens at 400 W
    e = m.result()
    assert e["method"] == COUNTER
    assert e["seconds"] == pytest.approx(6.0) and e["tokens"] == 1280 and e["segments"] == 5
    assert e["joules"] == pytest.approx(2400.0) == e["counter_joules"]
    assert e["avg_watts"] == pytest.approx(400.0)
    assert e["joules_per_token"] == pytest.approx(2400.0 / 1280)
    assert e["watts"] == {"min": 400.0, "median": 400.0, "max": 400.0, "n": 10}  # a reading at each start and stop
    assert e["sampled_joules"] == pytest.approx(2400.0)
    assert e["event_seconds"] == pytest.approx(6.0 - 5e-5)
    assert e["gpu_pci_bus_id"] == BUS
    m.close()
    assert reader.closed


def test_counter_is_preferred_over_the_samples_when_they_disagree():
    clock, reader = Clock(), FakeReader()
    m = EnergyMeter(reader, clock=clock, interval_s=None)
    run_segments(m, reader, clock, [(2.0, 700.0, 300, 300, 100)])  # the samples say 600 J, the counter 700 J
    e = m.result()
    assert e["method"] == COUNTER and e["joules"] == pytest.approx(700.0)
    assert e["sampled_joules"] == pytest.approx(600.0) and e["avg_watts"] == pytest.approx(350.0)


def test_short_region_falls_back_to_the_power_samples():
    clock, reader = Clock(), FakeReader()
    m = EnergyMeter(reader, clock=clock, interval_s=None)
    run_segments(m, reader, clock, [(0.1, 40.0, 300, 500, 8), (0.1, 40.0, 300, 500, 8)])  # 0.2 s in all
    e = m.result()
    assert e["method"].startswith(SAMPLES) and "0.200 s < 1 s" in e["method"]
    assert e["joules"] == pytest.approx(2 * 0.1 * 400)  # trapezoid 300 -> 500 W over 0.1 s, twice
    assert e["counter_joules"] == pytest.approx(80.0)  # still recorded
    assert e["avg_watts"] == pytest.approx(400.0) and e["joules_per_token"] == pytest.approx(80.0 / 16)
    assert e["watts"] == {"min": 300.0, "median": 400.0, "max": 500.0, "n": 4}


def test_counter_that_did_not_move_falls_back():
    clock, reader = Clock(), FakeReader()
    m = EnergyMeter(reader, clock=clock, interval_s=None)
    run_segments(m, reader, clock, [(1.5, 300.0, 200, 200, 50), (1.5, 0.0, 200, 200, 50)])
    e = m.result()
    assert e["method"] == f"{SAMPLES} (the energy counter did not move)"
    assert e["joules"] == pytest.approx(600.0) and e["avg_watts"] == pytest.approx(200.0)


def test_no_counter_on_this_gpu_uses_the_samples_and_says_why():
    clock, reader = Clock(), FakeReader(counter=False)
    m = EnergyMeter(reader, clock=clock, interval_s=None)
    run_segments(m, reader, clock, [(3.0, 0.0, 250, 250, 30)])
    e = m.result()
    assert e["method"] == f"{SAMPLES} (no energy counter: NVMLError_NotSupported: Not Supported)"
    assert e["counter_joules"] is None and e["joules"] == pytest.approx(750.0)
    assert e["joules_per_token"] == pytest.approx(25.0)


def test_integrate_trapezoids_and_clamps_boundary_samples():
    assert integrate([(0.0, 100.0), (1.0, 300.0), (2.0, 300.0)], 0.0, 2.0) == pytest.approx(200 + 300)
    # the ends hold the nearest sample; a reading just after the end counts at the end
    assert integrate([(0.5, 100.0), (2.1, 100.0)], 0.0, 2.0) == pytest.approx(200.0)
    assert integrate([], 0.0, 1.0) is None
    seg = Segment(t0=0.0, e0=None, t1=1.0, e1=None, samples=[], tokens=4)
    assert summarize_energy([seg], BUS, "no energy counter: x") == {
        "unavailable": "no energy counter: x, and no power samples"}
    assert summarize_energy([], BUS) == {"unavailable": "nothing was measured"}


def test_sampler_thread_adds_samples_between_start_and_stop():
    import time

    reader = FakeReader()
    m = EnergyMeter(reader, interval_s=0.005)  # the real clock and a real thread
    m.start()
    time.sleep(0.1)
    m.stop(10)
    e = m.result()
    assert e["watts"]["n"] > 4 and e["watts"]["median"] == 400.0
    assert e["method"].startswith(SAMPLES)  # 0.1 s, and the fake counter did not move
    assert e["avg_watts"] == pytest.approx(400.0)
    m.close()


def test_a_failing_reader_gives_a_reason_not_an_exception():
    clock, reader = Clock(), FakeReader()
    m = EnergyMeter(reader, clock=clock, interval_s=None)
    run_segments(m, reader, clock, [(1.0, 300.0, 300, 300, 10)])
    reader.fail_power = True
    m.start()
    m.stop(10)
    assert m.result() == {"unavailable": "NVML reading failed: RuntimeError: NVML_ERROR_GPU_IS_LOST"}
    m.close()


def test_unavailable_when_pynvml_is_not_importable(monkeypatch):
    real_import = builtins.__import__

    def no_pynvml(name, *a, **kw):
        if name == "pynvml":
            raise ModuleNotFoundError("No module named 'pynvml'")
        return real_import(name, *a, **kw)

    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_pynvml)
    m = open_meter(BUS)
    assert isinstance(m, Unavailable) and m.measures is False
    m.start()
    m.stop(256)
    m.close()
    e = m.result()
    assert list(e) == ["unavailable"] and "\n" not in e["unavailable"]
    assert e["unavailable"].startswith("pynvml is not importable") and "atomflow-bench[energy]" in e["unavailable"]


def fake_pynvml(bus_ids: dict, fail: set = frozenset()):
    """A pynvml stand-in: handles by PCI bus id only (a lookup by index is an error)."""
    mod = types.ModuleType("pynvml")
    calls = []

    class NVMLError(Exception):
        pass

    def call(name, *args):
        calls.append(name)
        if name in fail:
            raise NVMLError(f"{name}: Not Supported")

    def by_bus(bus):
        call("nvmlDeviceGetHandleByPciBusId")
        assert isinstance(bus, bytes)
        for k, h in bus_ids.items():
            if bus_key(k) == bus_key(bus):
                return h
        raise NVMLError("Not Found")

    mod.NVMLError = NVMLError
    mod.nvmlInit = lambda: call("nvmlInit")
    mod.nvmlShutdown = lambda: call("nvmlShutdown")
    mod.nvmlDeviceGetHandleByPciBusId = by_bus
    mod.nvmlDeviceGetHandleByIndex = lambda i: pytest.fail("NVML's index order is not CUDA's")
    mod.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(
        busId=next(k for k, v in bus_ids.items() if v == h).encode())
    mod.nvmlDeviceGetPowerUsage = lambda h: call("nvmlDeviceGetPowerUsage") or 123_000
    mod.nvmlDeviceGetTotalEnergyConsumption = lambda h: call("nvmlDeviceGetTotalEnergyConsumption") or 42
    mod.calls = calls
    return mod


def test_open_meter_finds_the_gpu_by_pci_bus_id(monkeypatch):
    nv = fake_pynvml({"00000000:18:00.0": "gpu-a", "00000000:3B:00.0": "gpu-b"})
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    m = open_meter("0000:3b:00.0")  # CUDA's spelling, lower case; NVML's has an 8-digit domain
    assert isinstance(m, EnergyMeter) and m.reader.handle == "gpu-b" and m.reader.counter_note is None
    assert m.reader.pci_bus_id == "0000:3b:00.0"
    m.close()
    assert nv.calls[-1] == "nvmlShutdown"


def test_open_meter_without_a_counter_or_a_device(monkeypatch):
    nv = fake_pynvml({"00000000:3B:00.0": "gpu-b"}, fail={"nvmlDeviceGetTotalEnergyConsumption"})
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    m = open_meter(BUS)
    assert isinstance(m, EnergyMeter) and m.reader.counter_note.startswith("no energy counter: NVMLError")
    m.close()
    m = open_meter("0000:AF:00.0")
    assert isinstance(m, Unavailable) and m.result() == {"unavailable": "NVML refused: NVMLError: Not Found"}
    assert nv.calls[-1] == "nvmlShutdown"  # the failed open let NVML go
    nv = fake_pynvml({"00000000:3B:00.0": "gpu-b"}, fail={"nvmlInit"})
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    assert open_meter(BUS).result() == {"unavailable": "NVML refused: NVMLError: nvmlInit: Not Supported"}


def test_bus_key_spellings():
    assert bus_key("0000:3B:00.0") == bus_key("00000000:3b:00.0") == bus_key(b"3b:00.0") == (0, 0x3B, 0, 0)
    assert bus_key("not a bus") is None


def run_table_md(rec) -> str:
    from atomflow_bench.measure.run_record import run_table

    rec = dict(rec)
    rec.update({"vram_bytes": {"weights": 1 << 30, "kv": 1 << 20, "activations": 1 << 20, "scratch": 1 << 20,
                               "total": (1 << 30) + (3 << 20)},
                "load": {"seconds": 1.0}, "launches_per_step": 5})
    return text(run_table(rec), "md")


def energy_row(md: str) -> str | None:
    rows = [ln for ln in md.splitlines() if ln.startswith("| energy ")]
    assert len(rows) <= 1
    return rows[0] if rows else None


def test_run_table_energy_row_measured_and_unavailable():
    clock, reader = Clock(), FakeReader()
    m = EnergyMeter(reader, clock=clock, interval_s=None)
    run_segments(m, reader, clock, [(0.598 * 256 / 412, 0.598 * 256, 412, 412, 256)] * 5)  # 1.86 s in all
    rec = make_run(3.0)
    rec["energy"] = m.result()
    row = energy_row(run_table_md(rec))
    assert "412 W average, 0.598 J/token (NVML energy counter, 5 x 256 tokens)" in row

    rec["energy"] = {"unavailable": "pynvml is not importable (ModuleNotFoundError: No module named 'pynvml')"}
    row = energy_row(run_table_md(rec))
    assert "unavailable: pynvml is not importable" in row

    del rec["energy"]  # a record from before the field: no row
    assert energy_row(run_table_md(rec)) is None


def test_compare_does_not_look_at_energy():
    """Shown, not gated: the compare gate's code never reads the field."""
    from pathlib import Path

    from atomflow_bench.measure import gate as compare

    assert "energy" not in Path(compare.__file__).read_text()


def test_peer_meter_is_on_torchs_gpu_by_pci_bus_id(monkeypatch):
    """measure/peers.py: a CPU peer has no energy; a CUDA peer's meter is on torch's current GPU, by bus id."""
    from atomflow_bench.measure.peers import _meter

    assert _meter(None, "cpu").result() == {"unavailable": "device cpu: no GPU power to read"}
    props = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0)
    cuda = types.SimpleNamespace(current_device=lambda: 1, get_device_properties=lambda i: props)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml({"00000000:18:00.0": "gpu-a", "00000000:3B:00.0": "gpu-b"}))
    m = _meter(types.SimpleNamespace(cuda=cuda), "cuda")
    assert isinstance(m, EnergyMeter) and m.reader.handle == "gpu-b"
    m.close()
