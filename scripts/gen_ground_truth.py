#!/usr/bin/env python3
"""Ground truth for `atomflow-bench validate`: HuggingFace transformers (LlamaForCausalLM, fp32, eager).

    python scripts/gen_ground_truth.py MODEL [--prompt TEXT] [--steps N] --out DIR [--device cuda|cpu]

MODEL is a catalog name, hub repo id or model directory (as for `atomflow-bench fetch`). Writes
DIR/truth.safetensors (per position: embed, each layer's attn / mlp residual, final_norm, logits; float32)
and DIR/truth.json (model, weights sha256, prompt ids, generated ids, torch/transformers versions, device).
Runs on CUDA when torch sees a device (TF32 off), else on the CPU. The logic lives in atomflow_bench.validate.truth;
docs/VALIDATION.md describes the files.
"""
from __future__ import annotations

import sys

import click
from rich.console import Console
from rich.markup import escape

from atomflow_bench.errors import AtomflowError
from atomflow_bench.store.fetch import resolve_model
from atomflow_bench.validate.truth import DEFAULT_PROMPT, DEFAULT_STEPS, generate_truth


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model")
@click.option("--prompt", default=None, help=f"Prompt text (default: {DEFAULT_PROMPT!r}; models without a tokenizer "
                                              "get 8 seeded random token ids).")
@click.option("--steps", default=DEFAULT_STEPS, show_default=True, type=click.IntRange(1, 4096),
              help="Greedy tokens generated.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Output directory.")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default=None, help="Default: cuda if available.")
def main(model, prompt, steps, out_dir, device):
    """Dump transformers' fp32 hidden states and logits for PROMPT + STEPS greedy tokens of MODEL."""
    console = Console()
    try:
        path = resolve_model(model, console=console)
        m = generate_truth(path, out_dir, prompt=prompt, steps=steps, device=device, console=console)
    except AtomflowError as e:
        Console(stderr=True).print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(1)
    console.print(f"[green]ok[/green] {out_dir}: {len(m['prompt_ids'])} prompt + {m['steps']} generated tokens, "
                  f"{m['positions']} positions; generated ids {m['generated_ids'][:16]}"
                  f"{' …' if len(m['generated_ids']) > 16 else ''}")


if __name__ == "__main__":
    main()
