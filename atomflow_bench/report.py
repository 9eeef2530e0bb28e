"""Stage 8 of the decode path: the results record (versioned JSON) and its rich table.

Schema `atomflow-bench/run/1` (documented in README.md, section "Results JSON"). Every number in it is
measured in the run that wrote it, except `model`, `weights`, `context`, ... which describe the run.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from . import __version__
from .store import write_json_atomic

SCHEMA = "atomflow-bench/run/1"
GEMV_FORMS = {"ws": "warp-specialised: producer warp + bulk copies", "ring": "per-warp ring (fp8) / registers (fp16)",
              "dyn": "warp-specialised with dynamic split-K units of 16 KB"}
REQUIRED = ("schema", "gpu", "model", "weights", "context", "tokens", "tpot_ms", "copy_bandwidth_gbs",
            "bytes_per_token", "roofline")


def choice_lengths(ch: dict) -> str:
    """Where the engine timed its form choice: "length 416", or "lengths 208 and 416 (mean)"."""
    ls = ch.get("lengths") or [ch["length"]]
    return f"length {ls[0]}" if len(ls) == 1 else "lengths " + " and ".join(map(str, ls)) + " (mean)"


def gemv_form_text(form: str) -> str:
    """What a layer-GEMV form name (engine.gemv_form: ring, ws, ws-pre<N>, ring+<roles>, dyn, dyn-pre<N>, +dyn:<role>
    entries, each maybe with engine.l2_suffix's "/l2=<MB>") means, for the run table."""
    from .engine import gemv_form, l2_suffix  # the one parser of the forms

    form, l2 = l2_suffix(form)
    if l2 is not None:
        asked = f"the last {l2} MB of gate/up's weights" if l2 else "nothing"
        return f"{gemv_form_text(form)}; QKV asks L2 for {asked}"
    ws, pre, ws_roles, dyn = gemv_form(form)
    if form.startswith("dyn"):
        text = GEMV_FORMS["dyn"]
    else:
        text = GEMV_FORMS["ws" if ws else "ring"] + (f", but {', '.join(ws_roles)} warp-specialised" if ws_roles else "")
        text += f", {', '.join(dyn)} {GEMV_FORMS['dyn']}" if dyn else ""
    return text + (f", {pre} ring slots filled before the PDL wait" if pre is not None else "")


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
    import hashlib

    from .kernels import KERNELS_DIR

    h = hashlib.sha256()
    for base, suffixes in ((package or Path(__file__).resolve().parent, (".py",)),
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
    name = f"run-{slug(rec['model']['name'])}-{rec['weights']}-ctx{rec['context']}-{slug(rec['gpu']['name'])}-{stamp}.json"
    return results_dir / name


def write(rec: dict, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, rec)
    return path


def load(path: Path) -> dict:
    from .errors import AtomflowError

    try:
        rec = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise AtomflowError(f"{path}: not found") from None
    except json.JSONDecodeError as e:
        raise AtomflowError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(rec, dict) or rec.get("schema") != SCHEMA:
        raise AtomflowError(f"{path}: not an {SCHEMA} results file (schema={rec.get('schema') if isinstance(rec, dict) else None!r})")
    missing = [k for k in REQUIRED if k not in rec]
    if missing:
        raise AtomflowError(f"{path}: results file lacks field {missing[0]!r}")
    return rec


def command_line() -> str:
    return " ".join(["atomflow-bench"] + [a if " " not in a else repr(a) for a in sys.argv[1:]])


def _gib(n) -> str:
    return f"{n / 2**30:.3f} GiB"


def run_table(rec: dict):
    """The `run` table (rich.Table)."""
    from rich.table import Table

    t = Table(title=f"atomflow-bench run — {rec['model']['name']} {rec['weights']}", show_header=False,
              title_justify="left")
    t.add_column("metric", style="bold")
    t.add_column("value")
    g = rec["gpu"]
    tp = rec["tpot_ms"]
    t.add_row("GPU", f"{g['name']} (sm_{g['cc'].replace('.', '')}, {g['sms']} SMs), driver CUDA {g['cuda_driver']}, "
                     f"runtime {g['cuda_runtime']}, CuPy {g['cupy']}")
    m = rec["model"]
    t.add_row("model", f"{m['name']} ({m['source']}), {m['params'] / 1e9:.3f} B params")
    t.add_row("weights", rec["weights"] + (" (FP8-E4M3 layers, group 128; fp16 embedding/lm_head)"
                                           if rec["weights"] == "fp8" else ""))
    t.add_row("context / generated", f"{rec['context']} prompt tokens, {rec['tokens']} generated x {rec['repeats']} repeats")
    if rec.get("instrument"):
        t.add_row("[red]INSTRUMENT[/red]", f"[red]{' '.join(rec['instrument'])}: a timing instrument — the outputs are wrong "
                                           "on purpose; this TPOT is a bound, not a result[/red]")
    t.add_row("TPOT (graph)", f"median {tp['median']:.4f} ms  (p10 {tp['p10']:.4f}, p90 {tp['p90']:.4f}, n={tp['n']})")
    t.add_row("tok/s", f"{rec['tok_per_s']:.1f}")
    b = rec["bytes_per_token"]
    t.add_row("bytes read / token", f"{b['total'] / 1e9:.4f} GB (weights {b['weights'] / 1e9:.4f} + KV {b['kv'] / 1e6:.2f} MB)")
    t.add_row("achieved bandwidth", f"{rec['bandwidth_gbs']:.0f} GB/s")
    cb = rec["copy_bandwidth_gbs"]
    t.add_row("copy bandwidth (same run)", f"{cb['median']:.0f} GB/s (p10 {cb['p10']:.0f}, p90 {cb['p90']:.0f}; "
                                           f"D2D copy of {cb['bytes'] >> 20} MiB, read+write)")
    r = rec["roofline"]
    t.add_row("% of roofline", f"[bold]{r['pct']:.1f}%[/bold]  (floor {r['tpot_floor_ms']:.4f} ms = bytes / copy bandwidth)")
    v = rec["vram_bytes"]
    t.add_row("VRAM by pool", f"weights {_gib(v['weights'])}, KV {_gib(v['kv'])}, activations "
                              f"{v['activations'] / 2**20:.2f} MiB, scratch {v['scratch'] / 2**20:.2f} MiB; total {_gib(v['total'])}")
    e = rec.get("eager")
    if e:
        t.add_row("eager (--no-graph)", f"median {e['tpot_ms']['median']:.4f} ms -> graph speedup "
                                        f"x{e['graph_speedup']:.2f}; same tokens: {e['same_tokens']}")
    gen = rec.get("generated", {})
    if gen:
        text = gen.get("text")
        shown = repr(text[:120]) if text else str(gen["token_ids"][:16])
        t.add_row("first tokens", shown)
    t.add_row("launch", f"{rec['launches_per_step']} kernels/step in one CUDA Graph; "
                        f"programmatic dependent launch: {'on' if rec.get('pdl') else 'off'}")
    ch = rec.get("attention_choice")
    if ch:
        how = ch["mode"]
        if ch.get("step_us"):
            how = (f"measured at {choice_lengths(ch)}: short {ch['step_us']['short']:.1f} µs vs split "
                   f"{ch['step_us']['split']:.1f} µs per step -> {ch['chosen']}")
        buckets = ", ".join(f"{b['attention']} (lengths {b['lengths'][0]}-{b['lengths'][1]}"
                            + (f", GEMVs {b['gemv']}" if b.get("gemv") else "") + f"): {b['tpot_ms']:.4f} ms"
                            for b in rec.get("attention_buckets", []))
        t.add_row("attention", f"{how}; {buckets}")
    gc = rec.get("gemv_choice")
    if gc:
        def measured(c: dict) -> str:  # a GEMV choice: its timings, its form and what the form means
            how = c.get("mode") if not c.get("step_us") else (
                f"measured at {choice_lengths(c)}: " + " vs ".join(f"{f} {v:.1f} µs" for f, v in c["step_us"].items())
                + " per step")
            return f"{how} -> {c['chosen']} ({gemv_form_text(c['chosen'])})"

        text = measured(gc)
        if gc.get("split"):  # the split-attention bucket's own form (engine._choose)
            text += f"; split attention, {measured(gc['split'])}"
        t.add_row("layer GEMVs", text)
    keep = rec.get("l2_keep") or {}
    if keep.get("keep_mb"):  # LMHEAD_L2_KEEP: part of the counted bytes may come from L2 (PERF_NOTES v35)
        t.add_row("L2 kept", f"lm_head's last {keep['keep_mb']} MB loaded evict-last, L2 set-aside "
                             f"{keep['set_aside_bytes'] / 2**20:.1f} MiB: up to that much per token read from L2, "
                             f"still counted in the bytes and the roofline")
    t.add_row("load", f"{rec['load']['seconds']:.1f} s" + (f", fp8 from {rec['load']['fp8_source']}"
                                                            if rec['load'].get('fp8_source') else ""))
    return t

