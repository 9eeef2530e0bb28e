#!/usr/bin/env python3
"""Diagnostic (GPU): where the attention's time goes around one layer, beside QKV or as its own kernel, on a
tensor-parallel rank's local config on ONE GPU (as scripts/lab/local_step_ab.py), from the timeline instrument.

    scripts/lab/beside_timeline.py MODEL FMT TP LAYER FORMS LENGTH [LENGTH ...]

For each length: one instrumented replay at that length; for layer LAYER, in µs relative to the QKV GEMV blocks'
last end: QKV's GEMV blocks (median end, last end); each attention block (its window or head group: start, mark 0
= q and K/V in shared memory, 1 scores, 2 probabilities, 3 P.V, end); o_proj (first start, first release, median
end, last end) and gate/up's first release. Not part of any test or figure; docs/PERF_NOTES.md v43 quotes it. (The
attention beside QKV, kernels_cu/qkv_attention.cu, measured slower and removed, is in git history at commit 744fad5;
this script reads either step.)"""
from __future__ import annotations

import sys

import numpy as np


def main() -> int:
    from atomflow_bench.config import CATALOG
    from atomflow_bench.gpu import tp
    from atomflow_bench.gpu.engine import Engine
    from atomflow_bench.gpu.forms import Forms
    from atomflow_bench.gpu.synthetic import GpuSynthetic
    from atomflow_bench.lab import timeline
    from atomflow_bench.measure.bench import synthetic_prompt

    model, fmt, n, layer, forms = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    lengths = [int(x) for x in sys.argv[6:]]
    cfg = tp.local_config(CATALOG[model].config, n) if n > 1 else CATALOG[model].config
    eng = Engine(None, weights=fmt, max_seq=max(lengths) + 8, source=GpuSynthetic(cfg), forms=Forms.parse(forms),
                 kernel_defines=(timeline.DEFINE,))
    bufs = timeline.buffers
    for L in lengths:
        eng.reset(synthetic_prompt(cfg.vocab_size, L - 1))
        eng.run(L - 2)  # the next step runs at length L - 1 (a warm-up replay), then the recorded one at L
        eng.stream.synchronize()
        b = bufs(eng.lib)
        for _ in range(2):
            with eng.stream:
                timeline.clear(b)
            launches = eng.launches
            eng.run(1)
            eng.stream.synchronize()
        rec, _, block, lost = timeline.read_with_sm(b)
        ids, inv = np.unique(rec[:, 0], return_inverse=True)
        inv = inv.reshape(-1)
        per_layer = (len(launches) - 2) // cfg.num_hidden_layers  # embed + layers + lm_head (1 GPU)
        base = 1 + layer * per_layer
        names = [ln.name for ln in launches[base:base + per_layer + 1]]
        t = rec.astype(np.int64)

        def grid(i):
            sel = inv == base + i
            return t[sel], block[sel][:, 0]

        qkv, qb = grid(0)
        fused = names[0] == "qkv_attention"
        gemv_blocks = int(launches[base].args[-4]) if fused else len(qb)
        gq = qkv[qb < gemv_blocks]
        t0 = gq[:, 3].max()
        us = lambda x: (x - t0) / 1e3  # noqa: E731
        print(f"length {L} ({'beside' if fused else 'plain'}; launches {names}): QKV GEMV end median "
              f"{us(np.median(gq[:, 3])):+.2f} last {us(gq[:, 3].max()):+.2f} first start {us(gq[:, 1].min()):+.2f}")
        att, ab = (qkv[qb >= gemv_blocks], qb[qb >= gemv_blocks]) if fused else grid(1)
        for row, bi in sorted(zip(att.tolist(), ab.tolist()), key=lambda x: x[1]):
            marks = " ".join(f"{us(m):+.2f}" if m else "-" for m in row[4:8])
            print(f"  attention block {bi}: start {us(row[1]):+.2f} wait {us(row[2]) if row[2] else float('nan'):+.2f}"
                  f" marks {marks} end {us(row[3]):+.2f}")
        o, _ = grid(1 if fused else 2)
        w = o[:, 2][o[:, 2] > 0]
        release = us(w.min()) if w.size else float("nan")
        print(f"  o_proj: first start {us(o[:, 1].min()):+.2f} first release {release:+.2f}"
              f" end median {us(np.median(o[:, 3])):+.2f} last {us(o[:, 3].max()):+.2f} ({len(o)} blocks)")
        g, _ = grid(2 if fused else 3)
        w = g[:, 2][g[:, 2] > 0]
        print(f"  gate/up: first start {us(g[:, 1].min()):+.2f} first release {us(w.min()):+.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
