"""One rank of the tensor-parallel GPU tests (tests/test_tp_gpu.py starts N of these with RANK / WORLD_SIZE /
LOCAL_RANK / MASTER_ADDR / ATOMFLOW_TP_PORT set). Each task writes what it saw to OUT/<task>-rank<r>.json; the test
asserts. Usage: python tests/tp_worker.py TASK OUT [MODEL_DIR] (TASK: kernels, engine, prefill)"""
from __future__ import annotations

import faulthandler
import json
import signal
import sys
import time
from pathlib import Path

import numpy as np


T0 = time.monotonic()


def say(what: str) -> None:
    """A progress line on stderr (the test shows it when a rank fails or hangs)."""
    print(f"{time.monotonic() - T0:7.1f} s {what}", file=sys.stderr, flush=True)


def kernels(group, out: Path) -> dict:
    """The standalone peer sum and the argmax combine against NumPy, over several rounds (the LL epochs and the two
    alternating buffers), and the NCCL path's sum."""
    import cupy

    from atomflow_bench.gpu import tp
    from atomflow_bench.gpu.ops import kernel_lib
    from atomflow_bench.gpu.tp.sums import TpComm

    n, r, H = group.size, group.rank, 4096
    lib = kernel_lib()
    tpc = TpComm(group, lib, H, 4, [s * 100 for s in range(n)], "nccl")  # the peer path is set up where it can be
    res = {"peer": tpc.peer, "peer_reason": tpc.peer_reason, "sum_exact": [], "sum_ranks_equal": [],
           "nccl_sum_ok": [], "argmax": []}
    stream = cupy.cuda.Stream(non_blocking=True)
    for rnd in range(6):
        rng = np.random.default_rng(1000 + rnd)  # the same draw on every rank: each knows all partials
        parts = rng.standard_normal((n, H)).astype(np.float32) * np.float32(10.0 ** (rnd % 3 - 1))
        h0 = rng.standard_normal(H).astype(np.float32)
        acc = parts[0].copy()
        for s in range(1, n):
            acc = acc + parts[s]
        ref = h0 + acc
        if tpc.peer:
            with stream:
                h = cupy.asarray(h0)
                tpc.sum_alone_launch(rnd % 2, h, cupy.asarray(parts[r]))()
            stream.synchronize()
            got = h.get()
            res["sum_exact"].append(bool(np.array_equal(got, ref)))
            allh = group.allgather_host(got)
            res["sum_ranks_equal"].append(bool(all(np.array_equal(allh[0], allh[s]) for s in range(n))))
        # NCCL path as the step runs it: rank 0 holds h + its partial, the others their partial; in-place sum
        with stream:
            hn = cupy.asarray(h0 + parts[0] if r == 0 else parts[r])
            group.allreduce_op(hn)()
        stream.synchronize()
        gn = hn.get()
        alln = group.allgather_host(gn)
        res["nccl_sum_ok"].append(bool(np.allclose(gn, ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))
                                       and all(np.array_equal(alln[0], alln[s]) for s in range(n))))
    # the argmax combine: ties across ranks, NaN, a rank that saw nothing, nobody saw anything
    cases = [
        ([1.0] * n, [5] * n),                                   # a tie on every rank: the smallest global index
        ([float(s) for s in range(n)], [7] * n),                # the last rank's value wins
        ([np.nan] + [-1.0] * (n - 1), [3] * n),                 # NaN never wins
        ([-np.inf] + [2.0] * (n - 1), [tp.NO_INDEX] + [9] * (n - 1)),  # rank 0 saw no value
        ([-np.inf] * n, [tp.NO_INDEX] * n),                     # nobody: token 0
    ]
    offsets = [s * 100 for s in range(n)]
    a = {k: cupy.zeros(1, cupy.int32) for k in ("pos", "cur", "plen")}
    prompt = cupy.arange(16, dtype=cupy.int32)
    outt = cupy.full(16, -1, dtype=cupy.int32)
    for path in (["peer", "nccl"] if tpc.peer else ["nccl"]):
        for vals, idxs in cases:
            with stream:
                tpc.am_val[:1] = cupy.asarray(np.array([vals[r]], np.float32))
                tpc.am_idx[:1] = cupy.asarray(np.array([idxs[r]], np.int32))
                a["pos"][...] = 3
                a["plen"][...] = 2
                a["cur"][...] = -1
                outt[...] = -1
                for ln in tpc.argmax_launches((a["pos"], a["cur"], prompt, a["plen"], outt), path=path):
                    ln()
            stream.synchronize()
            gi = [i + o if i != tp.NO_INDEX else tp.NO_INDEX for i, o in zip(idxs, offsets)]
            want = tp.combine_argmax([v if i != tp.NO_INDEX else -np.inf for v, i in zip(vals, gi)], gi)[1]
            res["argmax"].append({"path": path, "want": int(want), "out": int(outt.get()[3]),
                                  "cur": int(a["cur"].get()[0]), "pos": int(a["pos"].get()[0])})
    return res


def engine(group, out: Path, model_dir: str) -> dict:
    """TP engine vs the one-GPU engine on the same checkpoint: probes per position (eager), graph == eager tokens, and
    the residual stream bit-identical on every rank."""
    import cupy

    from atomflow_bench.gpu.engine import Engine

    seq = [int(t) for t in np.random.default_rng(7).integers(0, 1000, 12)]
    names = ["embed", "layers.0.attn", "layers.0.mlp", "layers.2.mlp", "final_norm", "logits"]
    res = {}
    for fmt in ("fp16", "fp8"):
        for path in ("peer", "nccl"):
            eng = Engine(model_dir, weights=fmt, max_seq=32, group=group, allreduce=path)
            eng.reset(seq)
            probes, h_equal = [], []
            for _ in range(len(seq)):
                taps = eng.step_eager(taps=True)
                taps["logits"] = eng.tp.gather_vocab(taps["logits"], eng.cfg.vocab_size)
                probes.append({k: np.asarray(taps[k], np.float32).reshape(-1).tolist() for k in names})
                hh = group.allgather_host(eng.arena["h"].get())
                h_equal.append(bool(all(np.array_equal(hh[0], hh[s]) for s in range(group.size))))
            eager = eng.generate(seq[:4], 16, graph=False)
            graph = eng.generate(seq[:4], 16, graph=True)
            res[f"{fmt}-{path}"] = {"probes": probes, "h_equal": h_equal, "eager": eager, "graph": graph,
                                    "path": eng.tp.path}
            del eng
            cupy.get_default_memory_pool().free_all_blocks()
    group.barrier()
    if group.rank == 0:  # the one-GPU engine on the same weights
        for fmt in ("fp16", "fp8"):
            eng = Engine(model_dir, weights=fmt, max_seq=32)
            eng.reset(seq)
            res[f"{fmt}-tp1"] = {"probes": [{k: np.asarray(t[k], np.float32).reshape(-1).tolist() for k in names}
                                             for t in (eng.step_eager(taps=True) for _ in range(len(seq)))],
                                 "graph": eng.generate(seq[:4], 16, graph=True)}
            del eng
    group.barrier()
    return res


def prefill(group, out: Path, model_dir: str) -> dict:
    """The batched prefill under tensor parallel (chunks of 16 over a 45-token prompt: three chunks) against the
    prompt walked by the same ranks' decode step and (rank 0) the one-GPU prefill on the same checkpoint: the first
    decode step's logits (gathered over the vocabulary shards) and the greedy tokens, for both weights forms; the
    residual rows after every op (launch by launch) bit-identical on every rank; the graph replays' K/V close to
    the launches' K/V (test_prefill_gpu's bounds)."""
    import cupy

    from atomflow_bench.gpu.engine import Engine
    from atomflow_bench.gpu.prefill import Prefill

    prompt = [int(t) for t in np.random.default_rng(11).integers(0, 1000, 45)]
    n_new, chunk = 6, 16

    def first_logits(eng):  # the step at the last prompt token, after its K/V of positions 0 .. n-2
        taps = eng.step_eager(taps=True)
        logits = taps["logits"] if eng.tp is None else eng.tp.gather_vocab(taps["logits"], eng.cfg.vocab_size)
        return np.asarray(logits, np.float32).reshape(-1).tolist()

    def kv(eng):
        n = len(prompt) - 1
        eng.stream.synchronize()
        return [eng.arena[k][:, :n].get() for k in ("k_cache", "v_cache")]

    res = {}
    for fmt in ("fp16", "fp8"):
        say(f"{fmt}: engine")
        eng = Engine(model_dir, weights=fmt, max_seq=64, group=group)
        r = {"prefills": eng.prefills, "planned": eng.arena.prefill_form, "path": eng.tp.path}
        eng.reset(prompt)
        eng.run(len(prompt) - 1)
        r["walked_logits"] = first_logits(eng)
        r["walked"] = eng.generate(prompt, n_new)
        for form in ("copies", "staged"):
            say(f"{fmt} {form}: launch by launch")
            eng._prefill = pf = Prefill(eng, chunk=chunk, weights_form=form)
            h_equal = []

            def tap(name, rows):
                allh = group.allgather_host(rows.get())
                h_equal.append(bool(all(np.array_equal(allh[0], allh[s]) for s in range(group.size))))

            eng.reset(prompt)
            pf.fill(prompt, upto=len(prompt) - 1, taps=tap)
            eager_kv = kv(eng)
            say(f"{fmt} {form}: graphs")
            eng.reset(prompt)
            pf.fill(prompt, upto=len(prompt) - 1)  # each chunk a graph replay
            graph_kv = kv(eng)
            r[form] = {"form": pf.weights_form, "h_equal": h_equal, "logits": first_logits(eng),
                       "graph_kv_close": all(np.allclose(a.astype(np.float32), b.astype(np.float32), rtol=2e-3,
                                                         atol=1e-3) for a, b in zip(eager_kv, graph_kv)),
                       "tokens": eng.generate(prompt, n_new, prefill=True)}
        res[fmt] = r
        del eng, pf
        cupy.get_default_memory_pool().free_all_blocks()
    group.barrier()
    if group.rank == 0:  # the one-GPU prefill on the same weights
        for fmt in ("fp16", "fp8"):
            say(f"{fmt}: one GPU")
            eng = Engine(model_dir, weights=fmt, max_seq=64)
            eng._prefill = Prefill(eng, chunk=chunk)
            eng.reset(prompt)
            eng.fill(upto=len(prompt) - 1)
            res[fmt]["one_gpu_logits"] = first_logits(eng)
            res[fmt]["one_gpu"] = eng.generate(prompt, n_new, prefill=True)
            del eng
    group.barrier()
    return res


TASKS = {"kernels": kernels, "engine": engine, "prefill": prefill}


def main() -> None:
    task, out = sys.argv[1], Path(sys.argv[2])
    from atomflow_bench.gpu.tp.group import Group

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks a hung rank for its stacks
    group = Group()
    say(f"rank {group.rank}: {task}")
    try:
        res = TASKS[task](group, out, *sys.argv[3:])
    except BaseException:
        group.close(ok=False)  # no barrier its peers, inside another collective, would never reach
        raise
    group.close()
    say("done")
    (out / f"{task}-rank{group.rank}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
