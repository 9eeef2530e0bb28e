"""`plot`: PNGs from records (matplotlib, the optional extra `[plot]`; the Agg backend, no display needed).

* `context`: TPOT (median, p10-p90 bars) and % of the copy roofline against the context, one line per weight format;
  one figure per GPU and model (run records: a sweep's directory, or files).
* `compare`: ours against the engines measured on the SAME GPU, as bars of TPOT: a run record's live peers
  (`comparisons[]`, or `peers[]` when it has no comparisons), its recorded baselines of the same GPU, and the baseline
  records given (same GPU, same model, same context unless the baseline does not state one); one figure per run
  record that has any. Baselines of other GPUs are left
  out: absolute times across GPUs compare nothing (the `run` table gives their roofline-normalised ratio). Each bar
  says how much faster ours is; where its weight width differs from ours (an F16 bar beside our fp8 run,
  `comparison.weight_width`) the ratio is labelled with both widths.
* `roles`: from a `profile` record, what each role adds to the graph step (`role_marginals.rows[].saved_us`) against
  its bytes floor (`floor_us`: the role's bytes at the copy bandwidth).
* `exchanges`: from a `profile --tp` record, rank 0's step (graph, position held) with and without its exchanges
  across ranks, and each path's exchanges of one token alone (`comm`).

Records are read under every id schemas.py lists for their kind; a profile/1 record may lack `role_marginals` (it then
gives no `roles` figure).

Every figure names the GPU and the model in its title and the records it came from in a footnote.
"""
from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

from .. import schemas
from ..errors import AtomflowError
from ..output import Tab
from . import run_record
from .baselines import catalog_name, same_gpu, validate
from .peer_table import weight_width

MISSING = "plot needs matplotlib, which is not installed: pip install 'atomflow-bench[plot]'"
ROLE_NAMES = {"wqkv": "QKV projection (wqkv)", "wo": "o_proj (wo)", "wgu": "gate/up (wgu)", "wd": "down (wd)",
              "lm_head": "lm_head", "attention_decode": "attention", "embed_lookup": "embedding lookup"}
OURS, PEER, BASELINE, FLOOR = "#1f77b4", "#ff7f0e", "#7f7f7f", "#2ca02c"


def require_matplotlib():
    """The Agg canvas and Figure classes, or AtomflowError naming the extra."""
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # optional extra: imported where it is used
        from matplotlib.figure import Figure  # optional extra: imported where it is used
    except ImportError:
        raise AtomflowError(MISSING) from None
    return FigureCanvasAgg, Figure


# ---- records -------------------------------------------------------------------------------------------
def load_records(paths) -> dict:
    """Run, profile and baseline records from files and directories (every *.json in a directory, not recursive).

    Returns {"runs": [(path, rec)], "profiles": [...], "baselines": [...], "ignored": [(path, why)]}. A file named
    explicitly must be one of those (or a sweep summary, ignored); in a directory, other files are ignored."""
    out = {"runs": [], "profiles": [], "baselines": [], "ignored": []}
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            files += [(f, False) for f in sorted(p.glob("*.json")) if f.is_file()]
        elif p.is_file():
            files.append((p, True))
        else:
            raise AtomflowError(f"{p}: no such file or directory")
    seen = set()
    for f, named in files:
        if f.resolve() in seen:
            continue
        seen.add(f.resolve())
        try:
            try:
                rec = json.loads(f.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise AtomflowError(f"{f}: not valid JSON ({e})") from None
            kind = schemas.check(rec, ("run", "profile", "baseline", "sweep"), f)
            if kind == "run":
                out["runs"].append((f, run_record.load(f)))
            elif kind == "profile":
                out["profiles"].append((f, read_profile(rec, f)))
            elif kind == "baseline":
                out["baselines"].append((f, validate(rec, str(f))))
            elif kind == "sweep":
                out["ignored"].append((f, "a sweep summary (its cells' records are read from their own files)"))
            else:
                schema = rec.get("schema") if isinstance(rec, dict) else None
                raise AtomflowError(f"{f}: not a run, profile or baseline record (schema={schema!r})")
        except AtomflowError as e:
            if named:
                raise
            out["ignored"].append((f, str(e).replace(f"{f}: ", "", 1)))
    return out


def read_profile(rec: dict, where) -> dict:
    """A profile record as the figures read it: `role_marginals` with its rows, or None where a profile/1 record has
    none; `comm` (with --tp) with the step's graph times; `prefill`, where present and not null, with its rows and
    the chunk graph's times. AtomflowError (one line) for a record that has neither roles nor comm, or a broken one."""
    roles, comm = rec.get("role_marginals"), rec.get("comm")
    optional = rec["schema"] == "atomflow-bench/profile/1"  # some records of this id have no role_marginals
    if not (roles is None and optional) and not (isinstance(roles, dict) and roles.get("rows")):
        raise AtomflowError(f"{where}: profile record without role_marginals.rows")
    if comm is not None and not (isinstance(comm, dict) and isinstance(comm.get("paths"), dict)
                                 and all(isinstance(comm.get(k), dict) for k in ("step_graph_us",
                                                                                  "step_without_exchanges_us"))):
        raise AtomflowError(f"{where}: profile record whose comm lacks paths, step_graph_us or "
                            "step_without_exchanges_us")
    pre = rec.get("prefill")  # optional: the earlier profile/2 records lack it
    if pre is not None and not (isinstance(pre, dict) and isinstance(pre.get("rows"), list)
                                and isinstance(pre.get("chunk_graph_us"), dict)):
        raise AtomflowError(f"{where}: profile record whose prefill lacks rows or chunk_graph_us")
    if roles is None and comm is None:
        raise AtomflowError(f"{where}: a profile record of the kernel table alone (neither role_marginals nor comm): "
                            "nothing of it to plot")
    return {**rec, "role_marginals": roles}


# ---- figure helpers ------------------------------------------------------------------------------------
def _gpu(rec: dict) -> str:
    g = rec.get("gpu")
    return str(g.get("name", "?") if isinstance(g, dict) else g or "?")


def _model(rec: dict) -> str:
    m = rec.get("model")
    return str(m.get("name", "?") if isinstance(m, dict) else m or "?")


def _from(paths, extra: str = "") -> str:
    """The footnote: which records the figure came from."""
    paths = [Path(p) for p in paths]
    parents = {str(p.parent) for p in paths}
    if len(paths) <= 4:
        names = ", ".join(str(p) for p in paths)
    elif len(parents) == 1:
        names = f"{len(paths)} records in {parents.pop()}/: " + ", ".join(p.name for p in paths[:3]) + ", ..."
    else:
        names = f"{len(paths)} records: " + ", ".join(str(p) for p in paths[:3]) + ", ..."
    return f"from {names}" + ("" if not extra else f" {extra}" if names.endswith("...") else f". {extra}")


def _figure(width: float, height: float, footnote: str):
    canvas_cls, figure_cls = require_matplotlib()
    lines = textwrap.wrap(footnote, width=int(width * 17)) or [""]
    fig = figure_cls(figsize=(width, height + 0.16 * len(lines)), dpi=110)
    canvas_cls(fig)
    fig.text(0.01, 0.01, "\n".join(lines), fontsize=7.5, color="#444444", ha="left", va="bottom")
    return fig, (0.13 * len(lines) + 0.08) / (height + 0.16 * len(lines))


def _save(fig, bottom: float, path: Path, written: set) -> Path:
    stem, n = path.stem, 2
    while path in written:
        path = path.with_name(f"{stem}-{n}.png")
        n += 1
    fig.tight_layout(rect=(0, bottom, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    written.add(path)
    return path


def _bytes(n: float) -> str:
    return next((f"{n / d:.1f} {u}" for d, u in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")) if n >= d), f"{n:.0f} B")


def _latest(items, key):
    """The newest record (by `created`) of each key; returns (kept, number dropped)."""
    best = {}
    for path, rec in items:
        k = key(rec)
        if k not in best or str(rec.get("created", "")) >= str(best[k][1].get("created", "")):
            best[k] = (path, rec)
    return list(best.values()), len(items) - len(best)


# ---- (a) TPOT and % of roofline against the context ----------------------------------------------------
def plot_context(runs, out_dir: Path, written: set | None = None) -> list[dict]:
    written = set() if written is None else written
    runs = [(p, r) for p, r in runs if not r.get("instrument")]
    groups: dict = {}
    for p, r in runs:
        groups.setdefault((_gpu(r), _model(r)), []).append((p, r))
    out = []
    for (gpu, model), items in sorted(groups.items()):
        items, dropped = _latest(items, lambda r: (r["weights"], r["context"]))
        tokens = sorted({r["tokens"] for _, r in items})
        note = (f"TPOT: median of every generated token's graph replay (CUDA events), bars p10-p90; {'/'.join(map(str, tokens))}"
                f" tokens generated per repeat. % of roofline = (bytes read per token / copy bandwidth measured in the same "
                f"run) / TPOT." + (f" {dropped} older record(s) of the same format and context not plotted." if dropped
                                   else ""))
        fig, bottom = _figure(12, 5.2, _from([p for p, _ in items], note))
        ax1, ax2 = fig.subplots(1, 2)
        contexts = sorted({r["context"] for _, r in items})
        for w in sorted({r["weights"] for _, r in items}):
            pts = sorted(((r["context"], r) for _, r in items if r["weights"] == w), key=lambda t: t[0])
            xs = [c for c, _ in pts]
            med = [r["tpot_ms"]["median"] for _, r in pts]
            lo = [m - r["tpot_ms"]["p10"] for m, (_, r) in zip(med, pts)]
            hi = [r["tpot_ms"]["p90"] - m for m, (_, r) in zip(med, pts)]
            label = {"fp8": "fp8 (W8A16: FP8-E4M3 weights)", "fp16": "fp16"}.get(w, w)
            line = ax1.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=4, label=label)
            for x, y in zip(xs, med):
                ax1.annotate(f"{y:.3f}", (x, y), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8,
                             color=line[0].get_color())
            pct = [r["roofline"]["pct"] for _, r in pts]
            ax2.plot(xs, pct, marker="o", label=label, color=line[0].get_color())
            for x, y in zip(xs, pct):
                ax2.annotate(f"{y:.1f}%", (x, y), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8,
                             color=line[0].get_color())
        for ax in (ax1, ax2):
            if len(contexts) > 1 and contexts[-1] / contexts[0] >= 8:
                ax.set_xscale("log", base=2)
            ax.set_xticks(contexts, [str(c) for c in contexts])
            ax.minorticks_off()
            ax.set_xlabel("context (prompt tokens before the timed decode)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=9, loc="best")
        ax1.set_ylabel("TPOT (ms per output token)")
        ax1.set_title("time per output token (lower is better)", fontsize=10)
        ax1.set_ylim(bottom=0, top=ax1.get_ylim()[1] * 1.08)
        ax2.set_ylabel("% of the copy-bandwidth roofline")
        ax2.set_title("% of roofline (higher is better; 100% = the bytes floor)", fontsize=10)
        ax2.axhline(100, color="#999999", linestyle="--", linewidth=1)
        ax2.set_ylim(0, max(105, max(r["roofline"]["pct"] for _, r in items) * 1.08))
        fig.suptitle(f"{model} on {gpu}: single-stream decode against context", fontsize=12)
        path = _save(fig, bottom, Path(out_dir) / f"context-{run_record.slug(model)}-{run_record.slug(gpu)}.png", written)
        out.append({"kind": "context", "path": path, "sources": [p for p, _ in items]})
    return out


# ---- (b) ours against the engines on the same GPU ------------------------------------------------------
def _comparators(rec: dict, baselines) -> tuple[list[dict], int, list]:
    """(bars other than ours on the same GPU, how many other-GPU rows were left out, baseline files used)."""
    gpu, bars, other, used = _gpu(rec), [], 0, []
    if isinstance(rec.get("comparisons"), list):
        for row in rec["comparisons"]:
            if row.get("kind") == "ours":
                continue
            if not row.get("same_gpu"):
                other += 1
                continue
            if not isinstance(row.get("tpot_ms"), (int, float)) or not row["tpot_ms"] > 0:
                continue
            bars.append({"kind": str(row.get("kind")), "engine": str(row.get("engine")), "precision": row.get("precision"),
                         "context": row.get("context"), "tpot_ms": row["tpot_ms"], "p10": None, "p90": None})
    for peer in rec.get("peers") or []:  # p10/p90 of the live peers; the peers themselves when there is no table
        match = next((b for b in bars if b["kind"] == "peer" and b["engine"] == peer.get("engine")), None)
        tp = peer.get("tpot_ms") or {}
        if match is not None:
            match.update(p10=tp.get("p10"), p90=tp.get("p90"))
        elif "comparisons" not in rec and same_gpu(str(peer.get("gpu", "")), gpu) and tp.get("median"):
            bars.append({"kind": "peer", "engine": peer["engine"], "precision": peer.get("precision"),
                         "context": peer.get("context"), "tpot_ms": tp["median"], "p10": tp.get("p10"),
                         "p90": tp.get("p90")})
    model = catalog_name(_model(rec))
    for path, b in baselines:
        if catalog_name(b["model"]) != model:
            continue
        if not same_gpu(b["gpu"]["name"], gpu) or b["context"] not in (None, rec.get("context")):
            continue  # another GPU, or another context than ours (a baseline that does not state one is kept)
        m, e = b["metrics"], b["engine"]
        fit, context = m.get("tpot_fit_ms"), b["context"]
        if fit:  # a published linear fit over the prompt length: evaluated at our context
            tpot, context = fit["intercept"] + fit["per_input_token"] * rec["context"], rec["context"]
        elif m.get("tpot_ms"):
            tpot = m["tpot_ms"]
        else:
            continue
        if any(x["kind"].startswith("baseline") and math.isclose(x["tpot_ms"], tpot) for x in bars):
            continue  # already in the record's comparisons
        engine = " ".join(x for x in (e["name"], e["version"]) if x) + (f" ({e['flags']})" if e["flags"] else "")
        bars.append({"kind": "baseline" + (", fitted line" if fit else ""), "engine": engine,
                     "precision": b["precision"], "context": context, "tpot_ms": tpot,
                     "p10": None if fit else m.get("tpot_p10_ms"), "p90": None if fit else m.get("tpot_p90_ms")})
        used.append(path)
    return bars, other, used


def _bar_label(b: dict) -> str:
    """A bar's tick label: the engine (its flags, which a record may spell out at length, left to the footnote's
    files) wrapped, then kind, the format's leading word and the context."""
    engine = b["engine"].split(" (")[0]
    fmt = str(b["precision"]).split(" (")[0]
    ctx = b["context"] if b["context"] is not None else "?"
    return "\n".join(textwrap.wrap(engine, width=44)[:2] + [f"{b['kind']}, {fmt}, ctx {ctx}"])


def plot_compare(runs, baselines, out_dir: Path, written: set | None = None) -> list[dict]:
    written = set() if written is None else written
    out = []
    kept, _ = _latest([(p, r) for p, r in runs if not r.get("instrument")],
                      lambda r: (_gpu(r), _model(r), r["weights"], r["context"], r["tokens"]))
    for path, rec in sorted(kept, key=lambda pr: (_gpu(pr[1]), _model(pr[1]), pr[1]["weights"], pr[1]["context"])):
        others, other_gpu, used = _comparators(rec, baselines)
        if not others:
            continue
        tp = rec["tpot_ms"]
        ours = {"kind": "ours", "engine": f"atomflow-bench {rec.get('tool', {}).get('version', '')}".strip(),
                "precision": rec["weights"], "context": rec["context"], "tpot_ms": tp["median"], "p10": tp.get("p10"),
                "p90": tp.get("p90")}
        bars = [ours] + sorted(others, key=lambda b: b["tpot_ms"])
        note = ("Bars: median TPOT; whiskers p10-p90 where the source gives them. Peers: measured in the same process "
                "on the same weights and shape; baselines: recorded (see their source: engine flags, format, method). "
                "A ratio across weight widths (16-bit against 8-bit) is labelled: it mixes the format into the engine."
                + (f" {other_gpu} comparison row(s) from other GPUs left out (absolute times across GPUs compare "
                   "nothing)." if other_gpu else ""))
        fig, bottom = _figure(11, 1.6 + 0.62 * len(bars), _from([path, *used], note))
        ax = fig.subplots()
        ys = list(range(len(bars)))[::-1]
        colors = [{"ours": OURS, "peer": PEER}.get(b["kind"], BASELINE) for b in bars]
        ax.barh(ys, [b["tpot_ms"] for b in bars], color=colors, height=0.6)
        width = weight_width(rec["weights"])
        for y, b in zip(ys, bars):
            if b["p10"] is not None and b["p90"] is not None:
                ax.errorbar(b["tpot_ms"], y, xerr=[[b["tpot_ms"] - b["p10"]], [b["p90"] - b["tpot_ms"]]],
                            color="black", capsize=3, linewidth=1)
            speed = ""
            if b["kind"] != "ours":
                ratio = b["tpot_ms"] / ours["tpot_ms"]
                speed = f"\n ours x{ratio:.2f} faster" if ratio >= 1 else f"\n ours x{1 / ratio:.2f} slower"
                theirs = weight_width(b["precision"])
                if theirs != width:  # a ratio across weight widths mixes the format into the engine: say so
                    speed += (f" (ours {width}-bit, this {theirs}-bit)" if theirs and width
                              else " (weight width not stated)")
            ax.annotate(f" {b['tpot_ms']:.3f} ms, {1e3 / b['tpot_ms']:.0f} tok/s{speed}",
                        (max(b["tpot_ms"], b["p90"] or 0), y), va="center", fontsize=8.5)
        ax.set_yticks(ys, [_bar_label(b) for b in bars], fontsize=8.5)
        ax.set_xlim(0, max(b["p90"] or b["tpot_ms"] for b in bars) * 2.2)
        ax.set_xlabel("TPOT (ms per output token, lower is better)")
        ax.grid(True, axis="x", alpha=0.3)
        ax.set_title("\n".join(textwrap.wrap(f"{_model(rec)} on {_gpu(rec)}: ours ({rec['weights']}, ctx "
                                              f"{rec['context']}) against the engines on the same GPU", width=80)),
                     fontsize=11)
        name = f"compare-{run_record.slug(_model(rec))}-{rec['weights']}-ctx{rec['context']}-{run_record.slug(_gpu(rec))}.png"
        out.append({"kind": "compare", "path": _save(fig, bottom, Path(out_dir) / name, written),
                    "sources": [path, *used]})
    return out


# ---- (c) a profile's roles against their bytes floor ---------------------------------------------------
def plot_roles(profiles, out_dir: Path, written: set | None = None) -> list[dict]:
    written = set() if written is None else written
    out = []
    for path, rec in profiles:
        m = rec["role_marginals"]
        if m is None:
            continue
        rows = m["rows"]
        step = (m.get("step_us") or {}).get("median")
        cb = (rec.get("copy_bandwidth_gbs") or {}).get("median")
        note = ("role adds = the graph step (position held) minus the step replayed without that role's launches, "
                "overlap with its neighbours included; bytes floor = the role's bytes read at the copy bandwidth"
                + (f" ({cb:.0f} GB/s, same run)" if cb else "") + "."
                + (f" Step {step:.1f} µs; the roles add up to {m.get('sum_saved_us', 0):.1f} µs, their floors to "
                   f"{m.get('floor_us', 0):.1f} µs." if step else ""))
        fig, bottom = _figure(11, 1.8 + 0.55 * len(rows), _from([path], note))
        ax = fig.subplots()
        ys = list(range(len(rows)))[::-1]
        h = 0.38
        ax.barh([y + h / 2 for y in ys], [r["saved_us"] for r in rows], height=h, color=OURS,
                label="what the role adds to the step (µs)")
        ax.barh([y - h / 2 for y in ys], [r["floor_us"] for r in rows], height=h, color=FLOOR,
                label="its bytes floor at the copy bandwidth (µs)")
        top = max(max(r["saved_us"], r["floor_us"]) for r in rows)
        for y, r in zip(ys, rows):
            excess = r["saved_us"] - r["floor_us"]
            ax.annotate(f" {r['saved_us']:.1f} µs ({abs(excess):.1f} {'over' if excess >= 0 else 'under'} the floor)",
                        (max(r["saved_us"], 0), y + h / 2), va="center", fontsize=8.5)
            ax.annotate(f" {r['floor_us']:.1f} µs" + (f", {_bytes(r['bytes'])}" if "bytes" in r else ""),
                        (max(r["floor_us"], 0), y - h / 2), va="center", fontsize=8.5)
        ax.set_yticks(ys, [f"{ROLE_NAMES.get(r['role'], r['role'])}\n{r.get('count', '?')} launch"
                           f"{'' if r.get('count') == 1 else 'es'} per step" for r in rows], fontsize=8.5)
        ax.set_xlim(min(0, min(r["saved_us"] for r in rows) * 1.2), top * 1.45)
        ax.set_xlabel("µs per decode step")
        ax.grid(True, axis="x", alpha=0.3)
        ax.legend(fontsize=9, loc="best")
        ctx = rec.get("context")
        ax.set_title(f"{_model(rec)} {rec.get('weights', '')} on {_gpu(rec)}: what each role adds to the graph step "
                     f"(length {m.get('length', '?')}, ctx {ctx})", fontsize=11)
        name = f"roles-{run_record.slug(_model(rec))}-{rec.get('weights', 'x')}-ctx{ctx}-{run_record.slug(_gpu(rec))}.png"
        out.append({"kind": "roles", "path": _save(fig, bottom, Path(out_dir) / name, written), "sources": [path]})
    return out


# ---- (d) a tensor-parallel profile's step and its exchanges ----------------------------------------------
def plot_exchanges(profiles, out_dir: Path, written: set | None = None) -> list[dict]:
    written = set() if written is None else written
    out = []
    for path, rec in profiles:
        c = rec.get("comm")
        if c is None:
            continue
        bars = [("step (graph, position held)", c["step_graph_us"], OURS),
                ("the step without its exchanges", c["step_without_exchanges_us"], FLOOR),
                ("exchanges inside the step (the difference)", c.get("in_step_us"), PEER)]
        bars += [(f"{name}: one token's exchanges alone", p.get("token_graph_us") or p.get("per_token_us"), BASELINE)
                 for name, p in c["paths"].items()]
        bars = [(label, v if isinstance(v, dict) else {"median": v}, color) for label, v, color in bars
                if isinstance(v, (dict, int, float))]
        note = (f"Rank 0's graph replays at the profiled length, position held; the step's sums took the "
                f"{c.get('path')} path. Without its exchanges o_proj and down keep their partial sums (wrong values: a bound). Alone: "
                f"{c.get('sums_per_token', '?')} sums of {c.get('sum_bytes', '?')} B and the argmax combine in one "
                "graph. Bars: medians, whiskers p10-p90.")
        fig, bottom = _figure(11, 1.6 + 0.55 * len(bars), _from([path], note))
        ax = fig.subplots()
        ys = list(range(len(bars)))[::-1]
        ax.barh(ys, [v["median"] for _, v, _ in bars], color=[color for _, _, color in bars], height=0.6)
        for y, (_, v, _) in zip(ys, bars):
            if v.get("p10") is not None and v.get("p90") is not None:
                ax.errorbar(v["median"], y, xerr=[[v["median"] - v["p10"]], [v["p90"] - v["median"]]],
                            color="black", capsize=3, linewidth=1)
            ax.annotate(f" {v['median']:.1f} µs", (max(v["median"], v.get("p90") or 0), y), va="center", fontsize=8.5)
        ax.set_yticks(ys, [label for label, _, _ in bars], fontsize=8.5)
        ax.set_xlim(0, max(v.get("p90") or v["median"] for _, v, _ in bars) * 1.25)
        ax.set_xlabel("µs per decode step")
        ax.grid(True, axis="x", alpha=0.3)
        tp, ctx = rec.get("tp", "?"), rec.get("context")
        ax.set_title("\n".join(textwrap.wrap(f"{_model(rec)} {rec.get('weights', '')} on {_gpu(rec)}, tensor parallel "
                                              f"over {tp} GPUs: the step and its exchanges (ctx {ctx})", width=80)),
                     fontsize=11)
        name = (f"exchanges-{run_record.slug(_model(rec))}-{rec.get('weights', 'x')}-tp{tp}-ctx{ctx}-"
                f"{run_record.slug(_gpu(rec))}.png")
        out.append({"kind": "exchanges", "path": _save(fig, bottom, Path(out_dir) / name, written), "sources": [path]})
    return out


def plot_all(paths, out_dir) -> dict:
    """Every plot the records allow; {"plots": [{"kind", "path", "sources"}], "ignored": [...], "notes": [...]}."""
    require_matplotlib()  # before anything is read or written
    recs = load_records(paths)
    if not recs["runs"] and not recs["profiles"]:
        raise AtomflowError(f"nothing to plot in {', '.join(map(str, paths))}: no run or profile record")
    out_dir = Path(out_dir)
    written: set = set()
    plots = plot_context(recs["runs"], out_dir, written)
    plots += plot_compare(recs["runs"], recs["baselines"], out_dir, written)
    plots += plot_roles(recs["profiles"], out_dir, written)
    plots += plot_exchanges(recs["profiles"], out_dir, written)
    notes = []
    if recs["runs"] and not any(p["kind"] == "compare" for p in plots):
        notes.append("no comparison plot: no run record has a peer or a baseline on its own GPU (run --peers, or "
                     "give a baseline record of the same GPU)")
    instr = [p for p, r in recs["runs"] if r.get("instrument")]
    if instr:
        notes.append(f"{len(instr)} timing-instrument record(s) not plotted (a bound, not a result): "
                     + ", ".join(str(p) for p in instr[:3]))
    return {"plots": plots, "ignored": recs["ignored"], "notes": notes}


def plots_table(res: dict):
    """`plot`: the PNGs plot_all wrote and the records each came from (output.Tab)."""
    t = Tab("plots written", ["plot", "png", "from"], key="plots")
    for p in res["plots"]:
        src = [str(s) for s in p["sources"]]
        t.add(p["kind"], str(p["path"]), ", ".join(src) if len(src) <= 3 else f"{len(src)} records: "
              + ", ".join(src[:3]) + ", ...")
    return t
