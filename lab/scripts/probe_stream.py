#!/usr/bin/env python3
"""The persistent-stream probe (lab/probe.py, lab/kernels/probe_stream.cu) on a model shape's step bytes.

    lab/scripts/probe_stream.py MODEL FMT [--att-ns N] [--slots S] [--chunk KB] [--reps R] [--sweep] [--only N,N]
                            [--json FILE]

Prints the table (every variant's median step time against the copy floor measured in the same run) and writes
the record to FILE (temp name, then rename)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# run as a file (python3 lab/scripts/probe_stream.py): the repository root onto the path, where the lab package lives
# beside the product
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("fmt", choices=("fp16", "fp8"))
    ap.add_argument("--att-ns", type=int, default=3000, help="modelled attention latency before each o_proj (ns)")
    ap.add_argument("--slots", type=int, default=12, help="ring chunks per block")
    ap.add_argument("--chunk", type=int, default=16, help="chunk size, KB")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="also other rings, sleeping polls, and the waits alone")
    ap.add_argument("--only", help="comma-separated variant names (of the sweep) to run, in that order")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)

    from rich.console import Console

    from atomflow_bench.config import get_preset
    from atomflow_bench.errors import AtomflowError
    from atomflow_bench.gpu.nvrtc import KernelLib
    from lab import KERNELS, KERNELS_DIR
    from lab.probe import probe_table, probe_variants, step_ops, stream_probe, sync_ops
    from atomflow_bench.gpu.device import gpu_info

    try:
        cfg = get_preset(a.model).config
        ops = step_ops(cfg, a.fmt)
        variants = probe_variants(a.att_ns, a.slots, a.chunk * 1024, a.sweep or bool(a.only))
        if a.only:
            by_name = {v["name"]: v for v in variants}
            unknown = [n for n in a.only.split(",") if n not in by_name]
            if unknown:
                raise AtomflowError(f"no probe variant {unknown[0]!r}; known: {', '.join(by_name)}")
            variants = [by_name[n] for n in a.only.split(",")]
        gpu = gpu_info()
        lib = KernelLib(KERNELS, KERNELS_DIR)
        res = stream_probe(lib, ops, gpu["sms"], variants, reps=a.reps)
        if a.sweep:  # the same number of waits with 16 bytes per block and op
            sync = stream_probe(lib, sync_ops(len(ops), gpu["sms"]), gpu["sms"],
                                [v for v in probe_variants(0, a.slots, a.chunk * 1024, True) if v["name"] in
                                 ("stream", "deps", "stream-fence", "deps-fence")], reps=a.reps,
                                copy=res["copy_bandwidth_gbs"])
            res["sync_only"] = {v["name"]: {"ms": v["ms"], "cycle_shares": v["cycle_shares"]} for v in sync["variants"]}
    except AtomflowError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    res.update({"model": a.model, "format": a.fmt, "gpu": gpu})
    Console().print(probe_table(res))
    if "sync_only" in res:
        print("the waits alone (%d ops of 16 B per block): " % len(ops)
              + ", ".join(f"{k} {v['ms']['median'] * 1e3:.1f} µs (cycles % blocked/data/dep/sync "
                          + "/".join(f"{100 * x['mean']:.0f}" for x in v["cycle_shares"].values()) + ")"
                          for k, v in res["sync_only"].items()))
    if a.json:
        tmp = a.json.with_name(a.json.name + ".tmp")
        tmp.write_text(json.dumps(res, indent=1))
        os.replace(tmp, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
