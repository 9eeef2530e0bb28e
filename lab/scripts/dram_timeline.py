"""Diagnostic (GPU, Nsight Compute): HBM's read throughput over graph-replayed decode steps, from the hardware's
PM sampling counters — where in a layer HBM idles. `lab/scripts/lab_check.sh dram` runs both halves.

    python3 lab/scripts/dram_timeline.py child MODEL WEIGHTS CONTEXT [REPLAYS]
        the workload: an Engine (kernel defines from ATOMFLOW_KERNEL_DEFINES, forms from ATOMFLOW_FORMS) at position
        CONTEXT, warmed up; MODEL as lab/local.py takes it (`name/tpN`: a rank's local config); then,
        between cudaProfilerStart and Stop, REPLAYS (default 2) graph replays of the step, each synchronised. Run
        it under ncu --profile-from-start off --graph-profiling graph --section PmSampling --clock-control none
    python3 lab/scripts/dram_timeline.py summary RAW.csv OUT.json N_LAYERS
        RAW.csv: `ncu -i REPORT --page raw --csv --print-metric-instances values`. Per profiled replay: the samples'
        interval, where the layers end (the lm_head's sustained stream), HBM's mean over the layers and over
        lm_head, the time per layer HBM spends below 10% of its peak, and the layer folded on its one deep dip
        (mean of each sample offset over the layers: HBM %, CTAs launched, tensor pipe %, SM cycles active).
        OUT.json keeps every series.

Not part of any test or figure; lab/PERF_NOTES.md (v30) quotes what it showed.
"""
from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path
import tempfile

import numpy as np

# run as a file (python3 lab/scripts/dram_timeline.py): the repository root onto the path, where the lab package lives
# beside the product
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SERIES = {  # short name -> the raw page's column (PmSampling section, GH100)
    "dram": "FBSP.TriageCompute.dramc__read_throughput.avg.pct_of_peak_sustained_elapsed",
    "ctas": "FE_B.TriageCompute.gr__ctas_launched_realtime.sum",
    "tensor": "TPC.TriageCompute.sm__pipe_tensor_cycles_active_realtime.avg.pct_of_peak_sustained_elapsed",
    "sm_active": "TPC.TriageCompute.sm__cycles_active.avg",
    "l2": "LTS.TriageCompute.lts__t_sector_throughput_srcunit_tex.avg.pct_of_peak_sustained_elapsed",
    "l2_hit": "LTS.TriageCompute.lts__average_t_sector_hit_rate_realtime.pct",
}


def child(model: str, weights: str, context: int, replays: int) -> None:
    import cupy

    from lab.local import lab_engine
    from atomflow_bench.measure.decode import synthetic_prompt

    eng = lab_engine(model, weights, context + 16 + replays)  # forms: ATOMFLOW_FORMS, else the engine's defaults
    eng.reset(synthetic_prompt(eng.cfg.vocab_size, context))
    eng.run(context - 4)
    eng.stream.synchronize()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    with eng.stream:
        start.record()
    eng.run(3)
    with eng.stream:
        end.record()
    end.synchronize()
    print(f"unprofiled: 3 replays {cupy.cuda.get_elapsed_time(start, end) / 3 * 1e3:.1f} us per step "
          f"(forms {eng.forms.text}, defines {os.environ.get('ATOMFLOW_KERNEL_DEFINES', '')!r})", flush=True)
    cupy.cuda.profiler.start()
    for _ in range(replays):
        eng.run(1)
        eng.stream.synchronize()
    cupy.cuda.profiler.stop()
    print(f"profiled {replays} replays at position {eng.position}", flush=True)


def read_raw(path: str) -> list[dict]:
    """Per profiled workload of the raw CSV page: {short name: samples} plus the sampling interval (µs)."""
    rows = list(csv.reader(open(path)))
    hdr = rows[0]

    def values(cell: str) -> np.ndarray:
        inner = cell[cell.index("(") + 1:cell.rindex(")")]
        return np.array([float(x.replace(",", "")) for x in inner.split(";")])

    out = []
    for r in rows[1:]:
        if not r or not r[0].strip().isdigit():
            continue  # the units row
        w = {k: values(r[hdr.index(c)]) for k, c in SERIES.items() if c in hdr}
        w["interval_us"] = float(r[hdr.index("profiler__pmsampler_interval_time")].split()[0])
        out.append(w)
    if not out:
        raise SystemExit(f"{path}: no profiled workload with PM samples")
    return out


def layers_of(dram: np.ndarray, n_layers: int) -> dict:
    """Sample indices: first active, lm_head start (the first window of 40 samples with at most two at or below 85%
    of HBM peak — the lm_head's stream dips for a sample every ~100 µs on 70B's TP4 rank shape — then its first
    sample above 85%), the layers' deep dips."""
    active = np.nonzero(dram > 5)[0]
    a = int(active[0])
    lm = next((i for i in range(a, len(dram) - 40) if (dram[i:i + 40] > 85).sum() >= 38), None)
    if lm is None:
        raise SystemExit("no lm_head stream (40 samples, at most two at or below 85% of HBM peak) in the replay")
    while dram[lm] <= 85:
        lm += 1
    dips = [i for i in range(a + 5, lm) if dram[i] < 10 and dram[i - 1] >= 10 and dram[i - 2] >= 10]
    return {"first": a, "lm_head": lm, "last": int(active[-1]), "dips": dips[-n_layers:]}


def summary(path: str, out: str, n_layers: int) -> None:
    result = []
    for k, w in enumerate(read_raw(path)):
        dt, d = w["interval_us"], w["dram"]
        at = layers_of(d, n_layers)
        a, lm = at["first"], at["lm_head"]
        per_layer = (lm - a) * dt / n_layers
        low = float(np.mean(d[a:lm] < 10)) * per_layer
        print(f"replay {k}: {len(d)} samples every {dt} us; layers {a}..{lm} ({per_layer:.1f} us per layer), "
              f"lm_head {lm}..{at['last']}; HBM mean {d[a:lm].mean():.1f}% over the layers, "
              f"{d[lm:at['last']].mean():.1f}% over lm_head; below 10%: {low:.2f} us per layer; "
              f"{len(at['dips'])} deep dips")
        fold = []
        for o in range(-4, int(round(per_layer / dt)) - 3):
            idx = [s + o for s in at["dips"] if a <= s + o < lm]
            fold.append({"offset": o, **{n: float(w[n][idx].mean()) for n in SERIES if n in w}})
        print("  offset " + " ".join(f"{n:>9}" for n in SERIES if n in w))
        for f in fold:
            print(f"  {f['offset']:6d} " + " ".join(f"{f[n]:9.1f}" for n in SERIES if n in w))
        result.append({"interval_us": dt, "layers": at, "us_per_layer": per_layer, "below10_us_per_layer": low,
                       "dram_mean_layers": float(d[a:lm].mean()), "dram_mean_lm_head": float(d[lm:at["last"]].mean()),
                       "fold": fold, "series": {n: w[n].tolist() for n in SERIES if n in w}})
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(out)) or ".", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({"raw": os.path.basename(path), "replays": result}, f)
    os.replace(tmp, out)


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode == "child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]) if len(sys.argv) > 5 else 2)
    elif mode == "summary":
        summary(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        raise SystemExit("usage: dram_timeline.py child MODEL WEIGHTS CONTEXT [REPLAYS] | summary RAW.csv OUT.json N_LAYERS")
