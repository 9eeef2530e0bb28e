"""`atomflow-bench` command line: it parses and prints; every command calls one module function.

The commands import their modules inside their bodies, so that `--help` and the CPU commands stay fast and work
without CuPy or a GPU (the one reason for the imports inside functions below). `run`, `profile`, `tune`, `validate`
and `sweep` get their run context from gpu/tp/context.py (one GPU or a group of ranks; none of them asks which).
Every error is `error: <one line>` on stderr with the exit codes of `main` (no traceback unless --debug).
"""
from __future__ import annotations

import signal
import sys

import click
from rich.markup import escape

from . import __version__, envs
from .cli_compare import baseline, compare, compare_peers, peers, plot
from .cli_setup import complete_model, doctor, fetch, generate, models, rm
from .config import CATALOG, DEFAULT_MODEL
from .errors import AtomflowError, GpuUnavailable, Terminated
from .cli_options import (FORMS_HELP, check_model_first, check_tp_options, measure_options, parse_forms, tp_options,
                          tp_timeout_option)
from .output import Out, PipeAwareGroup, PipeClosed, format_option, is_machine, notes_console, pipe_closed, render

console = Out()
err_console = Out(stderr=True)
_ARGV: list[str] = []  # the command line main() runs (a tensor-parallel launch starts its ranks with it)


@click.group(cls=PipeAwareGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="atomflow-bench")
def cli():
    """Single-stream (M=1) Llama decode on NVIDIA GPUs through CuPy RawKernels, measured honestly.

    \b
    Exit codes: 0 ok, 1 error (one line on stderr), 2 usage / compare refused, 3 no usable GPU, 70 internal error,
    130 interrupted (Ctrl-C), 143 terminated (SIGTERM); a closed pipe (| head) ends it as SIGPIPE does (141).
    --debug (anywhere on the line) shows the traceback of an error.
    Shell completion (commands, options, model names), e.g. in ~/.bashrc:
      eval "$(_ATOMFLOW_BENCH_COMPLETE=bash_source atomflow-bench)"   (zsh_source, fish_source)"""


# cli_compare, cli_setup
for command in (baseline, compare, compare_peers, doctor, fetch, generate, models, peers, plot, rm):
    cli.add_command(command)


@cli.command()
@click.argument("model", default=DEFAULT_MODEL, shell_complete=complete_model)
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
        tp, allreduce, tp_timeout, fmt):
    """Decode benchmark: TPOT, tok/s, bandwidth, % of the copy roofline, VRAM (default: synthetic Llama-3.2-3B)."""
    from pathlib import Path

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from .gpu.device import require_gpu
    from .gpu.tp.context import open_context
    from .measure import run_record
    from .measure.baselines import attach_comparisons, comparison_table, load_baselines
    from .measure.decode import benchmark
    from .measure.peers import measure_peers, require_torch
    from .measure.power import others_count, sharing_text
    from .store.fetch import fetch_model

    forms = parse_forms(forms)
    check_tp_options(tp, allreduce, with_peers=with_peers, retune=retune, tp_timeout=tp_timeout)
    notes = notes_console(fmt, console)  # stderr with --format csv/json: stdout holds the tables alone
    baselines = load_baselines(baselines_dir)  # a malformed file stops here, before the measurement
    check_model_first(model, tp, (context + tokens, f"--ctx {context} + --tokens {tokens}"), source)
    require_gpu()  # before anything is fetched or written: no GPU, no figure (exit 3)
    if with_peers:  # torch and transformers before the measurement, not after it
        require_torch("cuda")
    if json_path and not no_json and not Path(json_path).resolve().parent.is_dir():
        raise AtomflowError(f"--json {json_path}: the directory {Path(json_path).resolve().parent} does not exist")
    ctx = open_context(model, tp, allreduce, notes=notes, argv=_ARGV, source=source,  # the fetch: once, before ranks
                       tp_timeout=tp_timeout,
                       before_launch=(lambda: fetch_model(model, source=source, console=notes)) if source else None)
    with ctx, Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=notes,
                       transient=True) as progress:
        rec = benchmark(ctx, weights, context, tokens, repeats, progress=progress, forms=forms, retune=retune)
    if others_count(rec.get("other_gpu_processes")):  # the table says it too; this line reaches stderr
        notes.print(f"warning: {sharing_text(rec['other_gpu_processes'])}", soft_wrap=True, highlight=False,
                    markup=False)
    run_tab = run_record.run_table(rec)
    if not is_machine(fmt, console):  # people see it before the peers run; csv/json get one document at the end
        render(run_tab, fmt, console)
        click.echo("")
    peers = None
    if with_peers:
        peers = measure_peers(ctx.model_dir, context=context, tokens=tokens, repeats=min(repeats, 3), weights="fp16")
    cmp_tab = comparison_table(attach_comparisons(rec, baselines, peers))
    render([run_tab, cmp_tab] if is_machine(fmt, console) else cmp_tab, fmt, console)
    if not no_json and ctx.writes:
        out = run_record.write(rec, Path(json_path) if json_path else run_record.default_path(rec))
        notes.print(f"results: {out}", soft_wrap=True, highlight=False)


@cli.command()
@click.argument("model", default=DEFAULT_MODEL, shell_complete=complete_model)
@click.option("--weights", type=click.Choice(["fp8", "fp16"]), default="fp8", show_default=True)
@click.option("--ctx", "context", default=128, show_default=True, type=click.IntRange(1, 32000))
@click.option("--steps", default=20, show_default=True, type=click.IntRange(2, 1000))
@click.option("--prompt-tokens", type=click.IntRange(1, 32000), default=None,
              help="The prompt whose last prefill chunk is taken apart. Default: --ctx.")
@click.option("--forms", default=None, help=FORMS_HELP + " Default: a saved tune, else the defaults.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
@tp_options
@format_option
def profile(model, weights, context, steps, prompt_tokens, forms, json_path, tp, allreduce, tp_timeout, fmt):
    """Per-kernel time breakdown of one decode step (events, eager) + graph step time and idle gap, what each role
    adds inside the graph (the step replayed without it), and the last prefill chunk of a prompt op by op. With --tp:
    the step's graph time and the time of the sums across ranks (alone, per call and per token, for each path; and
    inside the step)."""
    from pathlib import Path

    from .gpu.device import require_gpu
    from .gpu.tp.context import open_context
    from .measure import run_record

    check_tp_options(tp, allreduce, tp_timeout=tp_timeout)
    forms = parse_forms(forms)
    prompt_tokens = prompt_tokens or context
    check_model_first(model, tp, max((context + steps, f"--ctx {context} + --steps {steps}"),
                                     (prompt_tokens, f"--prompt-tokens {prompt_tokens}")))
    require_gpu()
    with open_context(model, tp, allreduce, notes=notes_console(fmt, console), argv=_ARGV,
                      tp_timeout=tp_timeout) as ctx:
        eng = ctx.engine(weights, max(context + steps, prompt_tokens) + 64, given=forms, tune_missing=False)
        p, tables = ctx.profile(eng, context, steps, prompt_tokens)
    render(tables, fmt, console)
    if json_path and ctx.writes:
        rec = {**run_record.head("profile"), "gpu": eng.gpu, "model": model, "weights": weights, **p}
        run_record.write(rec, Path(json_path))


@cli.command()
@click.argument("model", default=DEFAULT_MODEL, shell_complete=complete_model)
@click.option("--weights", type=click.Choice(["fp8", "fp16"]), default="fp8", show_default=True)
@click.option("--ctx", "context", default=128, show_default=True, type=click.IntRange(1, 32000),
              help="The context `run` will use (the tune is kept per context + tokens).")
@click.option("--tokens", default=256, show_default=True, type=click.IntRange(1, 32000))
@format_option
def tune(model, weights, context, tokens, fmt):
    """Time every launch form on this GPU and save the fastest for `run` (keyed by GPU, shape, format, context and
    source hash, under $ATOMFLOW_HOME/tuning)."""
    from .gpu.device import require_gpu
    from .gpu.tp.context import open_context
    from .measure.tune import tune_notes, tune_table

    check_model_first(model, 1, (context + tokens, f"--ctx {context} + --tokens {tokens}"))
    require_gpu()
    notes = notes_console(fmt, console)
    ctx = open_context(model, notes=notes)
    eng = ctx.engine(weights, context + tokens, retune=True)
    render(tune_table(ctx.forms, f"tune — {model} {weights}, max_seq {context + tokens}, {eng.gpu['name']}"), fmt,
           console)
    for line in tune_notes(ctx.forms):
        notes.print(line, soft_wrap=True, highlight=False)


@cli.command()
@click.option("--models", default=DEFAULT_MODEL, show_default=True,
              help="Comma-separated models (catalog names, hub ids or local directories), e.g. llama-3.2-1b,llama-3.2-3b.")
@click.option("--weights", "weights_list", default="fp8", show_default=True, help="Comma-separated: fp8, fp16.")
@click.option("--ctx", "contexts", default="128", show_default=True,
              help="Comma-separated prompt lengths, 1 to 32000 each: each cell's prefill (TTFT) and the context "
                   "its timed decode starts at.")
@click.option("--tp", "tps", default="1", show_default=True,
              help="Comma-separated tensor-parallel degrees, e.g. 1,2,4 (a cell of tp > 1 is `run --tp N`; the "
                   "summary gives each its ratio and efficiency against tp 1).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="The sweep's directory: one run record per cell + summary.json/.csv/.md; give an earlier sweep's "
                   "directory to resume it (its valid records are kept)  [default: results/sweep-<time>]")
@measure_options
@tp_timeout_option
@format_option
def sweep(models, weights_list, contexts, tps, tokens, repeats, out_dir, source, baselines_dir, with_peers, forms,
          retune, tp_timeout, fmt):
    """`run` over a grid: --models x --weights x --ctx, one record per cell, resumable; a summary table (also
    summary.json/.csv/.md in --out, rewritten after every cell). A cell whose valid record is in --out is skipped; a
    failed cell is kept in the summary with its error and the sweep goes on (exit 1 at the end when a cell failed)."""
    import functools
    from pathlib import Path

    from .gpu import device
    from .gpu.tp.context import open_cell
    from .measure import sweep as sw
    from .measure.baselines import load_baselines

    try:
        cells = sw.grid(sw.split_list(models, "--models"), sw.parse_weights(weights_list), sw.parse_contexts(contexts),
                        sw.parse_tps(tps))
    except AtomflowError as e:
        raise click.BadParameter(str(e)) from None
    check_tp_options(max(c["tp"] for c in cells), "auto", tp_timeout=tp_timeout)
    forms = parse_forms(forms)
    notes = notes_console(fmt, console)
    baselines = load_baselines(baselines_dir)
    for model, tp in dict.fromkeys((c["model"], c["tp"]) for c in cells):  # every cell's model error, up front
        longest = max(c["context"] for c in cells if c["model"] == model)
        check_model_first(model, tp, (longest + tokens, f"--ctx {longest} + --tokens {tokens}"), source)
    device.require_gpu()  # no GPU: the whole sweep fails here, before anything is fetched or written (exit 3)
    if with_peers:
        from .measure.peers import require_torch

        require_torch("cuda")
    out = Path(out_dir) if out_dir else sw.default_out()
    gpu = device.gpu_info()["name"]
    notes.print(f"sweep: {len(cells)} cells on {gpu} into {out}", soft_wrap=True, highlight=False, markup=False)
    open_cell = functools.partial(open_cell, tp_timeout=tp_timeout)  # the ranks of a cell of tp > 1 get it
    run_cell = functools.partial(sw.benchmark_cell, open_cell=open_cell, baselines=baselines, peers=with_peers,
                                 forms=forms, retune=retune, source=source, console=notes, baselines_dir=baselines_dir)
    summary = sw.run_sweep(cells, out, run_cell, tokens=tokens, repeats=repeats, gpu=gpu, console=notes)
    render(sw.sweep_table(summary), fmt, console)
    notes.print(f"summary: {out / 'summary.json'} (.csv, .md)", soft_wrap=True, highlight=False, markup=False)
    if sw.counts(summary)["failed"]:
        sys.exit(1)


@cli.command()
@click.argument("model", default=DEFAULT_MODEL, shell_complete=complete_model)
@click.option("--weights", "formats", default="fp16,fp8", show_default=True, help="Comma-separated formats.")
@click.option("--reps", default=50, show_default=True, type=click.IntRange(5, 10000))
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
@format_option
def gemv(model, formats, reps, json_path, fmt):
    """Every GEMV shape of MODEL alone, L2-cold: µs, GB/s, % of the copy bandwidth of the same run."""
    from pathlib import Path

    from .config import ModelConfig, get_preset
    from .gpu.device import gpu_info, require_gpu
    from .gpu.ops import kernel_lib
    from .measure import run_record
    from .measure.profile import gemv_bench, gemv_table

    fmts = tuple(f.strip() for f in formats.split(","))
    if not fmts or any(f not in ("fp16", "fp8") for f in fmts):
        raise click.BadParameter(f"formats must be fp16 and/or fp8, got {formats!r}")
    cfg = get_preset(model).config if model in CATALOG else ModelConfig.from_file(Path(model) / "config.json")
    require_gpu()
    info = gpu_info()
    lib = kernel_lib()
    g = gemv_bench(cfg, lib, info["sms"], fmts, reps=reps, l2_bytes=info["l2_bytes"])
    render(gemv_table(g), fmt, console)
    if json_path:
        run_record.write({**run_record.head("gemv"), "gpu": info, "model": model, **g},
                         Path(json_path))


@cli.command()
@click.argument("model", default=DEFAULT_MODEL, shell_complete=complete_model)
@click.option("--weights", type=click.Choice(["fp8", "fp16"]), default="fp8", show_default=True)
@click.option("--truth", "truth_dir", type=click.Path(file_okay=False), default=None,
              help="Ground-truth directory: read, or made there when empty (needs torch + transformers; copy it to "
                   "a machine without them). Default: made and cached under $ATOMFLOW_HOME/truth.")
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
@click.option("--prefill-chunk", type=click.IntRange(1, 4096), default=None, help="Tokens per chunk of the prefill "
              "path checked (a small one crosses chunk boundaries on a short prompt)  [default: the product's chunk]")
@tp_options
@format_option
def validate(model, weights, truth_dir, steps, prompt, backend, allow_mismatch, quality, json_path, forms,
             prefill_chunk, tp, allreduce, tp_timeout, fmt):
    """Engine vs HF transformers fp32, probe by probe (exit 0 only if all pass); or --quality."""
    from pathlib import Path

    from .gpu.device import require_gpu
    from .gpu.tp.context import open_context
    from .measure import run_record
    from .store.fetch import resolve_model
    from . import validate as v

    notes = notes_console(fmt, console)
    check_tp_options(tp, allreduce, tp_timeout=tp_timeout)
    if tp > 1 and (quality or backend != "gpu"):
        raise click.BadParameter("--tp validates the GPU engine's probes (not --quality, not --backend numpy)",
                                 param_hint="--tp")
    check_model_first(model, tp, None if quality or steps is None else (steps + 1, f"--steps {steps} + a prompt token"))
    if backend == "gpu":  # before the model is fetched or the ground truth made
        require_gpu()
    ctx = open_context(model, tp, allreduce, notes=notes, argv=_ARGV,  # the model and its truth once, before ranks
                       tp_timeout=tp_timeout,
                       before_launch=lambda: v.prepare_truth(resolve_model(model, console=notes), truth_dir, steps,
                                                             prompt, console=notes))
    if quality:
        res = v.quality(ctx.model_dir, backend=backend, console=notes)
        v.print_quality(res, console, fmt)
        ok = res["pass"] is not False
    else:
        with ctx:
            res = v.validate(ctx.model_dir, weights=weights, truth_dir=truth_dir, steps=steps, prompt=prompt,
                             backend=backend, allow_mismatch=allow_mismatch, console=notes, forms=parse_forms(forms),
                             context=ctx, prefill_chunk=prefill_chunk)
        v.print_result(res, console, fmt)
        ok = res["summary"]["pass"]
    if json_path and ctx.writes:
        notes.print(f"results: {run_record.write(res, Path(json_path))}", soft_wrap=True, highlight=False)
    if not ok:
        sys.exit(1)


EXIT_ERROR, EXIT_NO_GPU, EXIT_INTERNAL = 1, 3, 70  # 2: click's usage errors and compare's refusals


def main(argv=None):
    """Exit codes: 0 ok; 1 an error the user can fix (one line on stderr); 2 usage (click) or `compare` refused;
    3 no usable GPU (the line names the cause); 70 an internal error (a bug: one line, --debug shows the traceback);
    130 interrupted, 143 terminated (SIGTERM; what was being written is removed); a reader that has gone (`| head`)
    ends it as SIGPIPE ends standard tools (141 in a shell), silently. `compare` also exits 1 for a regression."""
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
    if (envs.WORLD_SIZE or 1) == 1:  # a rank keeps the default: its launcher stops it, and a dead peer can't wait on it
        def terminated(signum, frame):
            raise Terminated()

        signal.signal(signal.SIGTERM, terminated)
    try:
        cli.main(args=args, prog_name="atomflow-bench", standalone_mode=False)
    except (PipeClosed, BrokenPipeError):
        pipe_closed()
    except click.exceptions.Abort:
        err_console.print("aborted")
        sys.exit(130)
    except click.ClickException as e:  # one line, as every error: usage errors exit 2
        hint = f" (see '{e.ctx.command_path} --help')" if isinstance(e, click.UsageError) and e.ctx else ""
        err_console.print(f"[red]error:[/red] {escape(' '.join(e.format_message().split()) + hint)}",
                          highlight=False, soft_wrap=True)
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
