"""The commands that compare: the recorded baselines (list, record), the HF transformers peers, the peers table from
files, the CI gate and the plots. They parse and print; cli.py registers them (the module docstring there says why the
imports are inside the commands)."""
from __future__ import annotations

import sys

import click

from .cli_setup import complete_model
from .config import DEFAULT_MODEL
from .output import Out, format_option, notes_console, render

console = Out()


@click.group()
def baseline():
    """Recorded baselines (baselines/*.json, schema atomflow-bench/baseline/1): list, record."""


@baseline.command("list")
@click.option("--baselines", "directory", type=click.Path(exists=True, file_okay=False), default=None,
              help="Baselines directory  [default: the recorded baselines shipped with atomflow-bench (baselines/)]")
@click.option("--dir", "old_directory", type=click.Path(exists=True, file_okay=False), default=None, hidden=True)
@format_option
def baseline_list(directory, old_directory, fmt):
    """Validate and list the recorded baselines."""
    from .measure.baselines import baselines_table, load_baselines

    if old_directory:  # the option's former name, still taken: every other command calls it --baselines
        notes_console(fmt, console).print("warning: --dir is now --baselines", highlight=False)
        directory = directory or old_directory
    render(baselines_table(load_baselines(directory)), fmt, console)


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
    from urllib.parse import urlparse

    from .measure.server_baseline import record_baseline, write_baseline
    from .measure.run_record import command_line

    url = urlparse(openai_url)
    if url.scheme not in ("http", "https") or not url.netloc:
        raise click.BadParameter(f"{openai_url!r} is not an http(s) URL such as http://127.0.0.1:8000",
                                 param_hint="--openai-url")

    rec = record_baseline(openai_url, served_model, gpu, catalog_model=catalog_model, gpu_bandwidth=gpu_bandwidth,
                          precision=precision, engine=engine, engine_version=engine_version, flags=flags,
                          prompt_tokens=prompt_tokens, max_tokens=max_tokens, requests=requests, timeout=timeout,
                          command=command_line(), weight_bytes=weight_bytes, weight_bytes_basis=weight_bytes_basis)
    m = rec["metrics"]
    console.print(f"TPOT median {m['tpot_ms']:.3f} ms (p10 {m['tpot_p10_ms']:.3f}, p90 {m['tpot_p90_ms']:.3f}), "
                  f"TTFT median {m['ttft_ms']:.1f} ms, {m['tok_per_s']:.1f} tok/s over {requests} requests")
    console.print(f"baseline: {write_baseline(rec, out)}")


@click.command()
@click.argument("model", default=DEFAULT_MODEL, shell_complete=complete_model)
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


@click.command("compare-peers")
@click.argument("results", nargs=-1, type=click.Path())
@click.option("--ours", "ours_path", type=click.Path(), default=None,
              help="The run record the others are compared with  [default: the first run record among RESULTS]")
@click.option("--baselines", "baselines_dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="Recorded baselines to add  [default: the recorded baselines shipped with atomflow-bench (baselines/)]")
@format_option
def compare_peers(results, ours_path, baselines_dir, fmt):
    """One table from files: run records (with their `--peers`), baseline files and the recorded baselines.

    TPOT, tok/s, bytes per token, % of the same-run copy roofline, speedup vs ours (same GPU only), roofline-normalised
    ratio (other GPUs). Rows of other models are left out with a note; fitted baselines are evaluated at our context."""
    from .measure.peer_table import compare_peers as rows_of, compare_peers_table

    if not results and not ours_path:
        raise click.UsageError("no files given (RESULTS... or --ours FILE)")
    rows, left_out = rows_of(results, ours=ours_path, baselines_dir=baselines_dir)
    render(compare_peers_table(rows), fmt, console)
    notes = notes_console(fmt, console)
    for line in left_out:
        notes.print(line, soft_wrap=True, highlight=False, markup=False)


@click.command()
@click.argument("baseline_json", type=click.Path())
@click.argument("new_json", type=click.Path())
@click.option("--max-regression", default="5%", show_default=True,
              help="Allowed TPOT (and TTFT) slow-down, in percent (0% to 100%), beyond the runs' p10-p90 bands.")
@format_option
def compare(baseline_json, new_json, max_regression, fmt):
    """CI gate: compare two `run` results files. Exit 0 ok, 1 regression, 2 refused.

    \b
    Exit codes:
      0  no regression: within the threshold, faster, or slower but within noise (a warning)
      1  a regression beyond the threshold, outside the p10-p90 bands, in TPOT or in TTFT
         (TTFT where both records hold it, prefill paths alike; and nothing else)
      2  refused, no verdict: the records are not comparable (another GPU, model, weights or
         context; a timing-instrument record), a figure is missing or not a positive finite
         number (NaN, inf, <= 0, a string, a bool, null), a file is missing, unreadable, not
         valid JSON or not a results file, --max-regression is bad, or anything unexpected
         failed; one line on stderr names the file and the field
    """
    try:
        from .measure.gate import gate

        code = gate(baseline_json, new_json, max_regression, console,
                    lambda line: click.echo(line, err=True), fmt=fmt)
    except Exception as e:  # not even the gate ran (an import failed): no verdict, and never 1
        click.echo(" ".join(f"error: compare failed, no verdict ({type(e).__name__}: {e})".splitlines()),
                   err=True)
        code = 2
    if code:
        sys.exit(code)


@click.command()
@click.argument("results", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="results/plots", show_default=True,
              help="Directory the PNGs are written to (created if missing; a PNG of the same name is replaced).")
@format_option
def plot(results, out_dir, fmt):
    """PNGs from records (RESULTS: files, or directories: every *.json in them, e.g. a sweep's): TPOT and % of
    roofline against context per model and format (run records); ours against the engines on the same GPU (a run
    record's peers and same-GPU baselines, and the baseline records given); a profile record's per-role time
    against its bytes floor, and a `profile --tp` record's step with and without its exchanges across ranks. Needs
    matplotlib: pip install 'atomflow-bench[plot]'."""
    from .measure.plot import plot_all, plots_table

    notes = notes_console(fmt, console)
    res = plot_all(list(results), out_dir)
    for path, why in res["ignored"]:
        notes.print(f"ignored {path}: {why}", soft_wrap=True, highlight=False, markup=False)
    for line in res["notes"]:
        notes.print(line, soft_wrap=True, highlight=False, markup=False)
    render(plots_table(res), fmt, console)
