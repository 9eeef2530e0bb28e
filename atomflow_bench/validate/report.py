"""What validate prints: the per-probe table and its summary lines, and the quality table and its verdict.

The tables go through output.render (markdown, csv or json); the lines beside them go to stderr with csv/json, so
stdout holds the table alone.
"""
from __future__ import annotations

from rich.markup import escape

from ..output import Num, Tab, notes_console, num, render


def print_result(res: dict, console, fmt: str | None = None) -> None:
    """The per-probe table (output.render in `fmt`) and the summary lines (on stderr with --format csv/json)."""
    th = res["thresholds"]
    cols = ["probe", "cos (min)", "rel L2", "max|diff|", "pos", "threshold", "result"]
    t = Tab(f"validate — {res['model']['name']} {res['weights']} vs transformers fp32 ({res['weights']} weight values)",
            cols, caption=f"engine: {res['backend']['label']}; worst position per probe", key="probes",
            right=("cos (min)", "rel L2", "max|diff|", "pos"))
    thr = f"≥{th['cos_min']:g}/≤{th['rel_max']:g}"
    for p in res["probes"]:
        t.add(p["name"], num(p["cos"], ".7f"), num(p["rel_l2"], ".2e"), num(p["max_abs"], ".2e"), num(p["worst_pos"]),
              thr, "PASS" if p["pass"] else "FAIL", cell_styles={"result": "green" if p["pass"] else "red bold"})
    render(t, fmt, console)
    console = notes_console(fmt, console)
    s = res["summary"]
    tr = res["truth"]
    col = "green" if s["probes_pass"] == s["probes_total"] else "red"
    console.print(f"[{col}]{s['probes_pass']}/{s['probes_total']} probes PASS[/{col}]"
                  + (f"  (first FAIL: {s['first_fail']})" if s["first_fail"] else ""), soft_wrap=True)
    console.print(f"greedy agreement: {s['greedy_agree']}/{s['greedy_total']} steps (engine argmax = HF argmax; "
                  f"prompt {len(tr['prompt_ids'])} tokens, {tr['positions']} positions teacher-forced)", soft_wrap=True)
    console.print(f"KL(HF || engine), last logits: {s['kl_last']:.3e} nats (≤ {th['kl_max']:g}) "
                  + ("[green]PASS[/green]" if s["kl_pass"] else "[red]FAIL[/red]")
                  + f"; max over positions {s['kl_max_over_positions']:.3e}", soft_wrap=True)
    d = res.get("drift")
    if d:
        console.print(f"fp8 quantization drift vs the unquantized model (not gated; see --quality): hidden min cos "
                      f"{d['hidden_min_cos']:.4f} (rel L2 ≤ {d['hidden_max_rel_l2']:.3f}), logits min cos "
                      f"{d['logits_min_cos']:.4f}, KL last {d['kl_last']:.2e} / mean {d['kl_mean']:.2e} nats, "
                      f"greedy = HF fp16 tokens {d['greedy_agree']}/{d['greedy_total']}", soft_wrap=True)
    pre = res.get("prefill")  # optional: a record may lack it
    if pre:
        for line in prefill_lines(pre):
            console.print(line, soft_wrap=True)
    for n in res.get("notes", []):
        console.print(f"[yellow]note: {escape(n)}[/yellow]", soft_wrap=True)
    console.print(("[green bold]PASS[/green bold]" if s["pass"] else "[red bold]FAIL[/red bold]")
                  + f" — {res['weights']} on {escape(res['backend']['label'])}"
                  + (" (decode and prefill paths)" if pre else ""), soft_wrap=True)


FAILS_SHOWN = 4  # the prefill's failing probes named one by one; the record has them all


def prefill_lines(pre: dict) -> list[str]:
    """The prefill path's lines: what ran, its probes' count and verdict, greedy agreement and KL; its first failing
    probes with their worst figures."""
    s = pre["summary"]
    b = pre["batched_positions"]
    where = (f"positions 0-{b - 1} batched in chunks of {pre['chunk']}" if b else "no position batched")
    col = "green" if s["probes_pass"] == s["probes_total"] else "red"
    kl = "[green]PASS[/green]" if s["kl_pass"] else "[red]FAIL[/red]"
    lines = [f"prefill path ({where}, then {pre['decode_positions']} decode steps from its cache): "
             f"[{col}]{s['probes_pass']}/{s['probes_total']} probes PASS[/{col}]"
             + (f"  (first FAIL: {s['first_fail']})" if s["first_fail"] else "")
             + f"; greedy agreement {s['greedy_agree']}/{s['greedy_total']}; KL last {s['kl_last']:.3e} {kl}; "
             + ("[green]PASS[/green]" if s["pass"] else "[red]FAIL[/red]")]
    fails = [p for p in pre["probes"] if not p["pass"]]
    for p in fails[:FAILS_SHOWN]:
        lines.append(f"  prefill [red]FAIL[/red] {p['name']}: cos {p['cos']:.7f}, rel L2 {p['rel_l2']:.2e} "
                     f"(worst at position {p['worst_pos']})")
    if len(fails) > FAILS_SHOWN:
        lines.append(f"  and {len(fails) - FAILS_SHOWN} more failing prefill probes (the --json record has them)")
    return lines


def print_quality(q: dict, console, fmt: str | None = None) -> None:
    """The fp8-vs-fp16 table (output.render in `fmt`) and the verdict line (on stderr with --format csv/json)."""
    cols = ["metric", "fp16", "fp8", "bound", "result"]
    t = Tab(f"quality — {q['model']['name']}: fp8 vs fp16 over {q['text']['tokens']} tokens ({q['backend']['label']})",
            cols, key="quality", right=("fp16", "fp8"))
    b, c = q["bounds"], q["checks"]

    def row(metric, fp16, fp8, bound, check=None):
        verdict = "" if check is None else "—" if q["pass"] is None else "PASS" if c[check] else "FAIL"
        t.add(metric, fp16, fp8, bound, verdict, cell_styles={"result": {"PASS": "green", "FAIL": "red"}.get(verdict)})

    none = Num(None, "")  # a figure the row has for fp8 alone
    row("perplexity", num(q["fp16"]["perplexity"], ".4f"), num(q["fp8"]["perplexity"], ".4f"),
        f"fp8/fp16 ≤ {b['ppl_ratio_max']:g} (is {q['ppl_ratio']:.4f})", "ppl_ratio")
    row("top-1 = next token", num(q["fp16"]["top1_next_token"], ".3f"), num(q["fp8"]["top1_next_token"], ".3f"), "")
    row("top-1 agreement fp8 vs fp16", none, num(q["top1_agreement"], ".4f"), f"≥ {b['top1_min']:g}", "top1_agreement")
    row("mean KL(fp16 || fp8) / token", none, num(q["mean_kl_fp16_fp8"], ".3e"), f"≤ {b['mean_kl_max']:g} nats",
        "mean_kl")
    row("max KL(fp16 || fp8)", none, num(q["max_kl_fp16_fp8"], ".3e"), "")
    render(t, fmt, console)
    console = notes_console(fmt, console)
    if q["note"]:
        console.print(f"[yellow]{escape(q['note'])}[/yellow]", soft_wrap=True)
    else:
        console.print("[green bold]PASS[/green bold]" if q["pass"] else "[red bold]FAIL[/red bold]")
