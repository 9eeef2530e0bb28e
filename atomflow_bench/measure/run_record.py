"""The results record (versioned JSON) and its table.

Schema `atomflow-bench/run/1` (documented in docs/RESULTS.md; schemas.py lists the ids a reader takes). Every number
in it is measured in the run that wrote it, except `model`, `weights`, `context`, ... which describe the run.
"""
from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from .. import __version__, schemas
from ..errors import AtomflowError
from ..gpu.forms import Forms
from ..gpu.nvrtc import KERNELS_DIR
from ..output import Num, Tab
from ..store.store import write_json_atomic
from .power import energy_text, others_count, sharing_text

SCHEMA = schemas.current("run")
REQUIRED = ("schema", "gpu", "model", "weights", "context", "tokens", "tpot_ms", "copy_bandwidth_gbs",
            "bytes_per_token", "roofline")


def forms_text(text: str) -> str:
    """What a forms text (gpu/forms.py) means, for the run table."""
    f = Forms.parse(text)

    def gemv(g) -> str:
        base = "warp-specialised (producer warp + bulk copies)" if g.ws else "per-warp ring (fp8) / registers (fp16)"
        pre = f", {g.ws_pre} ring slots filled before the PDL wait" if g.ws_pre is not None else ""
        pre += f", o_proj {g.wo_pre} before its wait" if g.wo_pre is not None else ""
        l2 = f"the last {g.l2_tail_mb} MB of gate/up's weights" if g.l2_tail_mb else "nothing"
        return f"{base}{pre}; QKV asks L2 for {l2}"

    if not f.short_attention:
        return f"split attention at every length; layer GEMVs {gemv(f.gemv_split)}"
    return f"short attention, layer GEMVs {gemv(f.gemv)}; beyond it split attention, layer GEMVs {gemv(f.gemv_split)}"


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def git_commit() -> str | None:
    return _git("rev-parse", "--short=12", "HEAD") or None


def git_dirty() -> bool | None:
    """Whether tracked files differ from that commit (None: no git): a record's commit alone does not name its code
    then — e.g. a device's copy of a working tree whose .git is older than its files."""
    out = _git("status", "--porcelain", "--untracked-files=no")
    return None if out is None else bool(out)


def source_sha256(package: Path | None = None, kernels: Path | None = None) -> str:
    """sha256 (16 hex digits) over the package's Python files and the kernel sources it compiles (kernels.KERNELS_DIR):
    each file's name relative to its directory and its bytes, in that order: the code that ran, named without git."""
    h = hashlib.sha256()
    for base, suffixes in ((package or Path(__file__).resolve().parents[1], (".py",)),
                           (kernels or KERNELS_DIR, (".cu", ".cuh"))):
        for p in sorted(q for q in Path(base).rglob("*") if q.is_file() and q.suffix in suffixes):
            h.update(p.relative_to(base).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def tool_info() -> dict:
    return {"name": "atomflow-bench", "version": __version__, "git_commit": git_commit(), "git_dirty": git_dirty(),
            "source_sha256": source_sha256(), "python": sys.version.split()[0]}


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", s).strip("-").lower()


def default_path(rec: dict, results_dir: Path = Path("results")) -> Path:
    stamp = rec["created"].replace(":", "").replace("-", "")
    tp = (rec.get("tp") or {}).get("n", 1)
    name = (f"run-{slug(rec['model']['name'])}-{rec['weights']}-ctx{rec['context']}" + (f"-tp{tp}" if tp > 1 else "")
            + f"-{slug(rec['gpu']['name'])}-{stamp}.json")
    return results_dir / name


def write(rec: dict, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, rec)
    return path


def load(path: Path) -> dict:
    try:
        rec = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise AtomflowError(f"{path}: not found") from None
    except json.JSONDecodeError as e:
        raise AtomflowError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if schemas.check(rec, ("run",), path) is None:
        raise AtomflowError(f"{path}: not an {SCHEMA} results file (schema={rec.get('schema') if isinstance(rec, dict) else None!r})")
    missing = [k for k in REQUIRED if k not in rec]
    if missing:
        raise AtomflowError(f"{path}: results file lacks field {missing[0]!r}")
    return rec


def command_line() -> str:
    return " ".join(["atomflow-bench"] + [a if " " not in a else repr(a) for a in sys.argv[1:]])


def head(kind: str) -> dict:
    """The fields every record of the tool starts with (profile, gemv and the run record itself); `kind` as in
    schemas.py."""
    return {"schema": schemas.current(kind), "tool": tool_info(), "created": now_iso(), "command": command_line()}


def _gib(n) -> str:
    return f"{n / 2**30:.3f} GiB"


def run_table(rec: dict):
    """The `run` table: metric / value rows (output.Tab). A row that gives one figure (with its spread or parts beside
    it) holds that figure as a Num, in the unit its text names first: TPOT and its eager median in ms, tok/s, bytes
    per token in GB, bandwidths in GB/s, % of roofline in percent, the sums across ranks and the exchanges in us,
    energy in J/token, load in s; the other rows are text."""
    t = Tab(f"atomflow-bench run — {rec['model']['name']} {rec['weights']}", ["metric", "value"], key="run",
            header=False, styles={(None, "metric"): "bold"})
    g = rec["gpu"]
    tp = rec["tpot_ms"]
    t.add("GPU", f"{g['name']} (sm_{g['cc'].replace('.', '')}, {g['sms']} SMs), driver CUDA {g['cuda_driver']}, "
                 f"runtime {g['cuda_runtime']}, CuPy {g['cupy']}")
    m = rec["model"]
    t.add("model", f"{m['name']} ({m['source']}), {m['params'] / 1e9:.3f} B params")
    t.add("weights", rec["weights"] + (" (FP8-E4M3 layers, group 128; fp16 embedding/lm_head)"
                                       if rec["weights"] == "fp8" else ""))
    t.add("context / generated", f"{rec['context']} prompt tokens, {rec['tokens']} generated x {rec['repeats']} repeats")
    sharing = rec.get("other_gpu_processes")
    if sharing is not None:
        t.add("other GPU processes", sharing_text(sharing), style="red" if others_count(sharing) else "")
    if rec.get("instrument"):
        t.add("INSTRUMENT", f"{' '.join(rec['instrument'])}: a timing instrument — the outputs are wrong on purpose; "
                            "this TPOT is a bound, not a result", style="red")
    t.add("TPOT (graph)", Num(tp["median"], f"median {tp['median']:.4f} ms  (p10 {tp['p10']:.4f}, p90 "
                                             f"{tp['p90']:.4f}, n={tp['n']})"))
    t.add("tok/s", Num(rec["tok_per_s"], f"{rec['tok_per_s']:.1f}"))
    ft, pf, tc = rec.get("ttft_ms"), rec.get("prefill"), rec.get("tensor_core_tflops")
    if ft and pf:
        how = (f"batched prefill, chunks of {pf['chunk']}" if pf["path"] == "batched"
               else "prompt walked through the decode step")
        how += ", weights staged before each GEMM" if pf.get("weights_form") == "staged" else ""
        how += f", attention on {pf['attention']}" if pf.get("attention") else ""  # optional: earlier records lack it
        t.add("TTFT", Num(ft["median"], f"median {ft['median']:.3f} ms  (p10 {ft['p10']:.3f}, p90 {ft['p90']:.3f}, "
                                        f"n={ft['n']}; {pf['prompt_tokens']} prompt tokens, {how}, to the first token)"))
        t.add("prompt tok/s", Num(pf["tok_per_s"], f"{pf['tok_per_s']:.0f}"))
        if tc:
            t.add("% of tensor-core peak", Num(pf["pct_of_peak"], f"{pf['pct_of_peak']:.1f}%  ({pf['tflops']:.0f} "
                                                                  f"TFLOPS of the prompt's {pf['flops'] / 1e12:.2f} "
                                                                  f"TFLOP in the TTFT; peak {tc['median']:.0f} TFLOPS "
                                                                  f"= cuBLAS fp16 GEMM {'x'.join(map(str, tc['shape']))}"
                                                                  ", same run)"))
    b = rec["bytes_per_token"]
    t.add("bytes read / token", Num(b["total"] / 1e9, f"{b['total'] / 1e9:.4f} GB (weights {b['weights'] / 1e9:.4f} "
                                                      f"+ KV {b['kv'] / 1e6:.2f} MB)"))
    t.add("achieved bandwidth", Num(rec["bandwidth_gbs"], f"{rec['bandwidth_gbs']:.0f} GB/s"))
    cb = rec["copy_bandwidth_gbs"]
    t.add("copy bandwidth (same run)", Num(cb["median"], f"{cb['median']:.0f} GB/s (p10 {cb['p10']:.0f}, p90 "
                                                         f"{cb['p90']:.0f}; D2D copy of {cb['bytes'] >> 20} MiB, "
                                                         "read+write)"))
    r = rec["roofline"]
    tpr = rec.get("tp")
    t.add("% of roofline", Num(r["pct"], f"{r['pct']:.1f}%  (floor {r['tpot_floor_ms']:.4f} ms = bytes / copy "
                                         "bandwidth" + (", per GPU: the slowest rank's" if tpr else "") + ")"),
          cell_styles={"value": "bold"})
    if tpr:
        c = tpr["comm"]
        ranks = ", ".join(f"{x['copy_bandwidth_gbs']:.0f}" for x in tpr["per_rank"])
        t.add("tensor parallel", f"{tpr['n']} GPUs, one process each; sums across ranks: {tpr['allreduce']}"
                                 + ("" if tpr["peer_available"] else f" (peer path off: {tpr['peer_reason']})")
                                 + f"; copy bandwidth per GPU {ranks} GB/s; bytes above are rank 0's")
        for path, v in c["paths"].items():
            t.add(f"sum across ranks ({path})", Num(v["sum_us"], f"{v['sum_us']:.2f} us per {c['sum_bytes'] // 1024} "
                                                                 f"KB sum inside a graph; one token's "
                                                                 f"{c['sums_per_token']} sums + argmax "
                                                                 f"{v['per_token_us']:.1f} us"
                                                                 + ("  <- the step's" if path == c["path"] else "")))
        t.add("exchanges inside the step", Num(c["in_step_us"], f"{c['in_step_us']:.1f} us per token (step "
                                                                f"{c['step_graph_us']['median']:.1f} us, without them "
                                                                f"{c['step_without_exchanges_us']['median']:.1f} us)"))
    v = rec["vram_bytes"]
    t.add("VRAM by pool", f"weights {_gib(v['weights'])}, KV {_gib(v['kv'])}, activations "
                          f"{v['activations'] / 2**20:.2f} MiB, scratch {v['scratch'] / 2**20:.2f} MiB; total {_gib(v['total'])}")

    energy = energy_text(rec.get("energy"))
    if energy:  # unavailable: the reason, as text
        t.add("energy", Num(rec["energy"]["joules_per_token"], energy) if "joules_per_token" in rec["energy"]
              else energy)
    e = rec.get("eager")
    if e:
        t.add("eager (--no-graph)", Num(e["tpot_ms"]["median"], f"median {e['tpot_ms']['median']:.4f} ms -> graph "
                                                                f"speedup x{e['graph_speedup']:.2f}; same tokens: "
                                                                f"{e['same_tokens']}"))
    gen = rec.get("generated", {})
    if gen:
        text = gen.get("text")
        shown = repr(text[:120]) if text else str(gen["token_ids"][:16])
        t.add("first tokens", shown)
    t.add("launch", f"{rec['launches_per_step']} kernels/step in one CUDA Graph; "
                    f"programmatic dependent launch: {'on' if rec.get('pdl') else 'off'}")
    fo = rec.get("forms")
    if fo:
        origin = {"tuned now": "tuned in this run", "saved": "a saved tune", "given": "given (--forms / ATOMFLOW_FORMS)",
                  "default": "the defaults (not tuned)"}.get(fo["origin"], fo["origin"])
        t.add("forms", f"{fo['forms']} — {origin}: {forms_text(fo['forms'])}")
        timed = fo.get("timed")
        if timed:
            best = sorted(timed["step_us"].items(), key=lambda kv: kv[1])[:3]
            t.add("tuned", f"{len(timed['step_us'])} forms timed at lengths {timed['lengths']}; fastest "
                           + ", ".join(f"{k} {v:.1f} µs" for k, v in best))
    buckets = ", ".join(f"{b['attention']} (lengths {b['lengths'][0]}-{b['lengths'][1]}, GEMVs {b['gemv']}): "
                        f"{b['tpot_ms']:.4f} ms" for b in rec.get("attention_buckets", []))
    if buckets:
        t.add("by attention bucket", buckets)
    t.add("load", Num(rec["load"]["seconds"], f"{rec['load']['seconds']:.1f} s"
                      + (f", fp8 from {rec['load']['fp8_source']}" if rec["load"].get("fp8_source") else "")))
    return t
