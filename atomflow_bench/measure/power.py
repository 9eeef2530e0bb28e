"""Energy per token through NVML (`pynvml`, package `nvidia-ml-py`: extra `[energy]`), around timed decode.

A meter measures a sequence of regions (segments) — in `run`, the graph replays of each of `bench.energy_passes`'
passes, which follow the timed repeats (their timing is untouched), never the prefill or the eager pass. The caller synchronises the GPU before
`start()` and after the region's last work, before `stop()`; the meter itself never touches the GPU.

* Energy: the driver's counter `nvmlDeviceGetTotalEnergyConsumption` (mJ since the driver loaded, Volta and later),
  read at `start()` and `stop()`; joules = the sum of the segments' deltas.
* Seconds: the host clock (`time.perf_counter`) read next to each counter read, summed over the segments — the same
  span the counter covers (a synchronised region: a few µs of launch latency at its start and of host wake-up at its
  end beyond the CUDA events' total, which is recorded too, as `event_seconds`). Average watts = joules / seconds.
* Power samples: `nvmlDeviceGetPowerUsage` (mW) at `start()`, every `SAMPLE_S` from a background thread, and at
  `stop()`: min / median / max watts and their count. (What the driver reports as "power usage" is itself averaged
  over a window that depends on the GPU and driver, so a sample is not an instantaneous figure.)
* Fallback: when the region is shorter than `MIN_COUNTER_S` in all, the counter did not move in some segment, or the
  GPU has no counter, the joules are the integral (trapezoids) of the power samples over each segment instead, and
  `method` says so and why. Both estimates are kept where there are (`counter_joules`, `sampled_joules`).

Nothing here raises into the benchmark: a missing `pynvml`, an NVML that refuses (no permission, no such device,
no power readings) or a failure mid-measurement makes the record `{"unavailable": "<one-line reason>"}`.

The NVML device is found by PCI bus id (CuPy's current device, or torch's for the peers), never by index: NVML
numbers all GPUs of the host, CUDA only those CUDA_VISIBLE_DEVICES lets it see, in its own order.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import envs

MIN_COUNTER_S = 1.0  # below this (the segments' total) the counter's update granularity can dominate
SAMPLE_S = 0.02      # the power sampler's period
COUNTER = "NVML energy counter"
SAMPLES = "integral of NVML power samples"


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text}" if type(e).__name__ not in text else text


def bus_key(bus_id) -> tuple | None:
    """(domain, bus, device, function) of a PCI bus id as CUDA ("0000:3B:00.0") or NVML ("00000000:3B:00.0") spell
    it; None when it does not parse."""
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode("ascii", "replace")
    try:
        dom_bus_dev, fn = str(bus_id).strip().rsplit(".", 1)
        parts = dom_bus_dev.split(":")
        if len(parts) == 2:
            parts = ["0"] + parts
        domain, bus, dev = (int(p, 16) for p in parts)
        return domain, bus, dev, int(fn, 16)
    except ValueError:
        return None


# ---- the NVML reader ----------------------------------------------------------------------------------------
class NvmlReader:
    """The NVML calls a meter makes, on one device (a pynvml handle). Tests give the meter another object with the same
    methods: `energy_mj()` (int, or raises when the GPU has no counter), `power_mw()` (int), `close()`, and the
    attributes `pci_bus_id` and `counter_note` (why there is no counter, else None)."""

    def __init__(self, nvml, handle, pci_bus_id: str):
        self.nvml, self.handle, self.pci_bus_id = nvml, handle, pci_bus_id
        self.counter_note = None

    def energy_mj(self) -> int:
        return int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))

    def power_mw(self) -> int:
        return int(self.nvml.nvmlDeviceGetPowerUsage(self.handle))

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 — shutting down is best effort
            pass


def import_pynvml():
    import pynvml  # the nvidia-ml-py package

    return pynvml


def open_nvml(pci_bus_id: str) -> NvmlReader:
    """An NvmlReader on the GPU at `pci_bus_id` (CUDA's spelling), checked: the handle's own bus id matches, a power
    reading works, and whether the energy counter does (`counter_note`). Raises on any failure."""
    nvml = import_pynvml()
    nvml.nvmlInit()
    try:
        bus = pci_bus_id.encode("ascii") if isinstance(pci_bus_id, str) else pci_bus_id
        handle = nvml.nvmlDeviceGetHandleByPciBusId(bus)
        got = nvml.nvmlDeviceGetPciInfo(handle).busId
        if bus_key(got) != bus_key(pci_bus_id):
            raise RuntimeError(f"NVML's device at {pci_bus_id} reports PCI bus id {got!r}")
        reader = NvmlReader(nvml, handle, pci_bus_id)
        reader.power_mw()
        try:
            reader.energy_mj()
        except Exception as e:  # noqa: BLE001 — e.g. NVML_ERROR_NOT_SUPPORTED before Volta
            reader.counter_note = f"no energy counter: {_one_line(e)}"
        return reader
    except BaseException:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
        raise


# ---- the meter ----------------------------------------------------------------------------------------------
@dataclass
class Segment:
    """One measured region: host-clock bounds, counter readings (mJ; None without a counter), power samples
    [(host time, watts)], tokens, and the CUDA events' total (ms) when the caller gave it."""
    t0: float
    e0: int | None
    t1: float | None = None
    e1: int | None = None
    samples: list = field(default_factory=list)
    tokens: int = 0
    event_ms: float | None = None


def integrate(samples, t0: float, t1: float) -> float | None:
    """Joules: the trapezoid integral of (time, watts) samples over [t0, t1], each end held at its nearest sample;
    a sample taken just outside (the boundary readings next to the counter's) counts at the bound. None without
    samples."""
    pts = sorted((min(max(t, t0), t1), w) for t, w in samples)
    if not pts:
        return None
    ts = np.array([t0] + [t for t, _ in pts] + [t1])
    ws = np.array([pts[0][1]] + [w for _, w in pts] + [pts[-1][1]])
    return float(np.sum((ws[1:] + ws[:-1]) / 2 * np.diff(ts)))


def summarize_energy(segments: list[Segment], pci_bus_id: str | None, counter_note: str | None = None,
                     min_counter_s: float = MIN_COUNTER_S) -> dict:
    """The `energy` record of finished segments: the counter's joules when the region lasted >= `min_counter_s` in all
    and the counter moved in every segment, else the power samples' integral (`method` says why)."""
    if not segments:
        return unavailable("nothing was measured")
    seconds = sum(s.t1 - s.t0 for s in segments)
    tokens = sum(s.tokens for s in segments)
    watts = [w for s in segments for _, w in s.samples]
    has_counter = counter_note is None and all(s.e0 is not None and s.e1 is not None for s in segments)
    counter_j = sum(s.e1 - s.e0 for s in segments) / 1e3 if has_counter else None
    parts = [integrate(s.samples, s.t0, s.t1) for s in segments]
    sampled_j = sum(parts) if parts and all(p is not None for p in parts) else None
    if not has_counter:
        why = counter_note or "the energy counter was not read"
    elif not all(s.e1 - s.e0 > 0 for s in segments):
        why = "the energy counter did not move"
    elif seconds < min_counter_s:
        why = f"region {seconds:.3f} s < {min_counter_s:g} s, too short for the energy counter's granularity"
    else:
        why = None
    if why is None:
        method, joules = COUNTER, counter_j
    elif sampled_j is not None:
        method, joules = f"{SAMPLES} ({why})", sampled_j
    else:
        return unavailable(f"{why}, and no power samples")
    if seconds <= 0 or tokens <= 0:
        return unavailable(f"an empty region ({seconds:.6f} s, {tokens} tokens)")
    ev = [s.event_ms for s in segments]
    return {
        "method": method, "joules_per_token": joules / tokens, "avg_watts": joules / seconds,
        "watts": ({"min": float(min(watts)), "median": float(np.median(watts)), "max": float(max(watts)),
                   "n": len(watts)} if watts else {"min": None, "median": None, "max": None, "n": 0}),
        "seconds": seconds, "event_seconds": sum(ev) / 1e3 if all(e is not None for e in ev) else None,
        "tokens": tokens, "segments": len(segments), "joules": joules,
        "counter_joules": counter_j, "sampled_joules": sampled_j, "gpu_pci_bus_id": pci_bus_id,
    }


def unavailable(reason: str) -> dict:
    return {"unavailable": " ".join(str(reason).split()) or "unknown"}


class Unavailable:
    """A meter that measures nothing and answers {"unavailable": reason}."""

    measures = False  # the caller need not synchronise anything for it

    def __init__(self, reason: str):
        self.reason = reason

    def start(self) -> None:
        pass

    def stop(self, tokens: int, event_ms: float | None = None) -> None:
        pass

    def result(self) -> dict:
        return unavailable(self.reason)

    def close(self) -> None:
        pass


class EnergyMeter:
    """start() / stop(tokens) around each region (the GPU synchronised at both), result() at the end, close(). Any
    failure of the reader turns the result into {"unavailable": ...}; nothing raises."""

    measures = True

    def __init__(self, reader, clock=time.perf_counter, interval_s: float | None = SAMPLE_S,
                 min_counter_s: float = MIN_COUNTER_S):
        self.reader, self.clock, self.interval_s, self.min_counter_s = reader, clock, interval_s, min_counter_s
        self.segments: list[Segment] = []
        self.failed: str | None = None
        self._seg: Segment | None = None
        self._thread: threading.Thread | None = None
        self._halt = threading.Event()

    def _counter(self) -> int | None:
        return None if self.reader.counter_note is not None else self.reader.energy_mj()

    def _sample(self, seg: Segment) -> None:
        w = self.reader.power_mw() / 1e3
        seg.samples.append((self.clock(), w))

    def _loop(self, seg: Segment) -> None:
        while not self._halt.wait(self.interval_s):
            try:
                self._sample(seg)
            except Exception as e:  # noqa: BLE001
                self.failed = self.failed or f"NVML power reading failed: {_one_line(e)}"
                return

    def start(self) -> None:
        if self.failed:
            return
        try:
            first = (self.clock(), self.reader.power_mw() / 1e3)
            e0 = self._counter()  # last, right before the caller queues the work: the region starts here
            seg = Segment(t0=self.clock(), e0=e0, samples=[first])
        except Exception as e:  # noqa: BLE001
            self.failed = f"NVML reading failed: {_one_line(e)}"
            return
        self._seg = seg
        if self.interval_s:
            self._halt.clear()
            self._thread = threading.Thread(target=self._loop, args=(seg,), name="atomflow-power", daemon=True)
            self._thread.start()

    def _join(self) -> None:
        if self._thread is not None:
            self._halt.set()
            self._thread.join()
            self._thread = None

    def stop(self, tokens: int, event_ms: float | None = None) -> None:
        seg, self._seg = self._seg, None
        if seg is None:
            return
        try:
            seg.e1 = self._counter()  # first, right after the caller synchronised: the region ends here
            seg.t1 = self.clock()
            self._join()
            self._sample(seg)
        except Exception as e:  # noqa: BLE001
            self._join()
            self.failed = self.failed or f"NVML reading failed: {_one_line(e)}"
            return
        seg.tokens, seg.event_ms = int(tokens), event_ms
        self.segments.append(seg)

    def result(self) -> dict:
        if self.failed:
            return unavailable(self.failed)
        try:
            return summarize_energy(self.segments, self.reader.pci_bus_id, self.reader.counter_note,
                                    self.min_counter_s)
        except Exception as e:  # noqa: BLE001
            return unavailable(f"energy bookkeeping failed: {_one_line(e)}")

    def close(self) -> None:
        self._join()
        try:
            self.reader.close()
        except Exception:  # noqa: BLE001
            pass


def open_meter(pci_bus_id: str | None = None, **kw):
    """An EnergyMeter on the GPU at `pci_bus_id` (default: CuPy's current device), or an Unavailable one saying why
    (pynvml not installed, NVML refusing, ...). Never raises."""
    try:
        import_pynvml()
    except ImportError as e:
        return Unavailable(f"pynvml is not importable ({_one_line(e)}): pip install 'atomflow-bench[energy]'")
    try:
        if pci_bus_id is None:
            import cupy as cp  # optional extra: imported where it is used

            pci_bus_id = cp.cuda.Device().pci_bus_id
        return EnergyMeter(open_nvml(pci_bus_id), **kw)
    except Exception as e:  # noqa: BLE001 — NVMLError, a missing driver library, no permission, ...
        return Unavailable(f"NVML refused: {_one_line(e)}")


# ---- who else is on the GPU ---------------------------------------------------------------------------------
def our_pids() -> set[int]:
    """This process, its parent, and under a group its sibling ranks (the children of the same launcher): they may
    hold contexts on this GPU (a launcher's device query, a rank's peer memory) without sharing its time."""
    pids = {os.getpid(), os.getppid()}
    if (envs.WORLD_SIZE or 1) > 1:
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # a process that ended while we looked
            if int(fields[1]) == os.getppid():
                pids.add(int(stat.parent.name))
    return pids


def other_gpu_processes(pci_bus_id: str | None = None, own=(), seen: dict | None = None, nvml=None) -> dict:
    """The processes other than `own` holding a compute context on the GPU at `pci_bus_id` (default: CuPy's current
    device), from NVML's running compute processes: {"checked": True, "processes": [{"pid", "name", "used_bytes"}]}
    (merged with an earlier answer `seen`, so a look before and one after the timings report both), or
    {"checked": False, "reason"} where NVML cannot say. Timings taken while another process runs kernels on the same
    GPU are not this engine's alone, so `run` says so. NVML names host pids: in a container (another pid namespace)
    this process is not among them by its own pid, so every entry is kept, `foreign_pids` is set, and one of them is
    this run (`others_count`). Never raises."""
    procs = {p["pid"]: p for p in (seen or {}).get("processes", [])}
    foreign = bool((seen or {}).get("foreign_pids"))
    try:
        nvml = nvml or import_pynvml()
    except ImportError as e:
        why = f"pynvml is not importable ({_one_line(e)}): pip install 'atomflow-bench[energy]'"
        return seen if seen and seen.get("checked") else {"checked": False, "reason": why}
    try:
        if pci_bus_id is None:
            import cupy as cp  # optional extra: imported where it is used

            pci_bus_id = cp.cuda.Device().pci_bus_id
        nvml.nvmlInit()
        try:
            bus = pci_bus_id.encode("ascii") if isinstance(pci_bus_id, str) else pci_bus_id
            running = nvml.nvmlDeviceGetComputeRunningProcesses(nvml.nvmlDeviceGetHandleByPciBusId(bus))
            foreign = foreign or (bool(running) and os.getpid() not in {int(p.pid) for p in running})
            ours = set() if foreign else set(own) | {os.getpid()}
            for p in running:
                pid = int(p.pid)
                if pid in ours or pid in procs:
                    continue
                try:
                    name = nvml.nvmlSystemGetProcessName(pid)
                    name = name.decode("utf-8", "replace") if isinstance(name, bytes) else str(name)
                except Exception:  # noqa: BLE001 — another user's process: NVML may not name it
                    name = None
                used = getattr(p, "usedGpuMemory", None)
                procs[pid] = {"pid": pid, "name": name, "used_bytes": int(used) if isinstance(used, int) else None}
        finally:
            nvml.nvmlShutdown()
    except Exception as e:  # noqa: BLE001 — NVMLError, a missing driver library, no permission, ...
        return seen if seen and seen.get("checked") else {"checked": False, "reason": f"NVML refused: {_one_line(e)}"}
    out = {"checked": True, "processes": sorted(procs.values(), key=lambda p: p["pid"])}
    return {**out, "foreign_pids": True} if foreign else out


def others_count(s: dict | None) -> int:
    """How many processes other than this run held the GPU (0 when not checked)."""
    procs = (s or {}).get("processes") or []
    return max(0, len(procs) - (1 if (s or {}).get("foreign_pids") else 0))


def sharing_text(s: dict | None) -> str | None:
    """The run table's "other GPU processes" value; None when the record has no such field (older records)."""
    if not s:
        return None
    if not s.get("checked"):
        return f"not checked: {s.get('reason')}"
    procs, n = s["processes"], others_count(s)
    if not n:
        return "none (NVML's running compute processes)"
    each = ", ".join(f"pid {p['pid']}" + (f" {p['name']}" if p.get("name") else "")
                     + (f" {p['used_bytes'] / 2**30:.2f} GiB" if p.get("used_bytes") is not None else "")
                     for p in procs)
    if s.get("foreign_pids"):
        each += "; host pids, one of them this run"
    return f"{n} other process(es) held this GPU during the run ({each}): the timings are not clean"


def energy_text(e: dict | None) -> str | None:
    """The run table's "energy" value; None when the record has no energy field (older records)."""
    if not e:
        return None
    if "unavailable" in e:
        return f"unavailable: {e['unavailable']}"
    n, seg = e["tokens"], e.get("segments") or 1
    shape = f"{seg} x {n // seg} tokens" if n % seg == 0 else f"{n} tokens in {seg} segments"
    w = e.get("watts") or {}
    spread = (f"; samples {w['min']:.0f}-{w['max']:.0f} W, median {w['median']:.0f} W, n={w['n']}"
              if w.get("n") else "")
    return f"{e['avg_watts']:.0f} W average, {e['joules_per_token']:.3f} J/token ({e['method']}, {shape}){spread}"
