"""Output for people and for machines: every table-printing command takes `--format table|md|csv|json`, prints
markdown when stdout is not a terminal (as under pytest), and a table never wraps into narrow cells there.

The CPU commands (`models`, `baseline list`, `compare`, `doctor`) run through the real CLI; the GPU ones (`run`,
`profile`, `gemv`, `tune`) run through the real CLI with their measurement replaced by recorded-style figures, and
their table builders are checked directly; `validate` and `peers` run for real where torch is installed."""
from __future__ import annotations

import csv
import io
import json
import os
import sys
from pathlib import Path

import pytest
from helpers_runs import make_run
from rich.console import Console
from rich.text import Text

from atomflow_bench import output
from atomflow_bench.config import CATALOG, ModelConfig, Preset
from atomflow_bench.measure.baselines import DEFAULT_DIR, load_baselines
from atomflow_bench.output import Tab, render, text
from atomflow_bench.store import listing, store
from helpers_cli import invoke

FORMATS = ["json", "csv", None]  # None: no --format; stdout is not a terminal under pytest: markdown
LONG = "a very long cell " * 30


# ---- parsing what the commands print ------------------------------------------------------------------
def md_tables(out: str) -> dict[str, list[dict]]:
    """Markdown tables in `out` by their bold title: a list of row dicts each, checking that every table has a header
    and a separator row of the same width and that every row is one line with one cell per column."""
    tables, title, lines = {}, None, out.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("**") and line.endswith("**"):
            title = line[2:-2]
        elif line.startswith("| "):
            header = split_md_row(line)
            sep = lines[i + 1]
            assert sep.startswith("|") and set(sep) <= set("|-:"), sep
            assert len(sep.strip("|").split("|")) == len(header)
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("| "):
                cells = split_md_row(lines[i])
                assert len(cells) == len(header), lines[i]
                rows.append(dict(zip(header, cells)))
                i += 1
            assert title not in tables, f"two tables titled {title!r}"
            tables[title] = rows
            continue
        i += 1
    return tables


def split_md_row(line: str) -> list[str]:
    assert line.startswith("| ") and line.endswith(" |"), line
    cells, cur, body, j = [], "", line[2:-2], 0
    while j < len(body):
        if body[j] == "\\" and j + 1 < len(body):
            cur += body[j + 1]
            j += 2
            continue
        if body.startswith(" | ", j):
            cells.append(cur)
            cur, j = "", j + 3
            continue
        cur += body[j]
        j += 1
    return cells + [cur]


def parse(out: str, fmt: str | None):
    """What a command printed, parsed: json as loaded; csv as a list of row dicts (one table) or {title: rows};
    md as {title: rows}."""
    if fmt == "json":
        return json.loads(out)
    if fmt == "csv":  # one CSV document; several tables: its first column names each row's table
        rows = list(csv.reader(io.StringIO(out)))
        assert rows and all(len(r) == len(rows[0]) for r in rows), out  # one header, every row as wide
        if rows[0][0] != "table":
            return [dict(zip(rows[0], r)) for r in rows[1:]]
        parsed = {}
        for r in rows[1:]:  # a row keeps the cells of its table's columns (the others are empty)
            parsed.setdefault(r[0], []).append({c: v for c, v in zip(rows[0][1:], r[1:]) if v != ""})
        return parsed
    return md_tables(out)


def quiet(err: str, fmt) -> bool:
    """stderr holds nothing but the tables' captions as notes (csv and json leave them out of stdout)."""
    return err == "" if fmt is None else all(line.startswith("note: ") for line in err.splitlines())


def fmt_args(fmt):
    return ["--format", fmt] if fmt else []


def rows_of(parsed, fmt, key: str, title_part: str | None = None):
    """The rows of one table of a command that prints several: by key in json, by (part of) the title otherwise."""
    if fmt in ("json", "csv"):
        return parsed.get(key, [])
    title_part = title_part or key
    [title] = [t for t in parsed if t and title_part in t]
    return parsed[title]


# ---- (a) one Tab in every format ----------------------------------------------------------------------
def sample() -> Tab:
    t = Tab("sample — a title", ["name", "value", "note"], right=("value",), caption="a caption")
    t.add("plain", "1.50", "")
    t.add("pipe", "2", "a|b")
    t.add("markup", "3", "[red]not markup[/red]")
    return t


def test_md_has_title_header_separator_rows_and_caption():
    out = text(sample(), "md")
    lines = out.splitlines()
    assert lines[0] == "**sample — a title**" and lines[1] == ""
    assert lines[2] == "| name | value | note |"
    assert lines[3] == "|---|---:|---|"
    assert lines[4] == "| plain | 1.50 |  |"
    assert lines[5] == "| pipe | 2 | a\\|b |"  # the cell's | escaped: still three cells
    assert lines[6] == "| markup | 3 | [red]not markup[/red] |"
    assert lines[7:] == ["", "a caption"]
    assert md_tables(out) == {"sample — a title": [dict(zip(["name", "value", "note"], r)) for r in sample().rows]}


def test_csv_parses_back_to_the_same_cells():
    out = text(sample(), "csv")
    assert list(csv.reader(io.StringIO(out))) == [sample().columns] + sample().rows


def test_json_is_a_list_of_objects_keyed_by_the_columns():
    assert json.loads(text(sample(), "json")) == [
        {"name": "plain", "value": "1.50", "note": ""}, {"name": "pipe", "value": "2", "note": "a|b"},
        {"name": "markup", "value": "3", "note": "[red]not markup[/red]"}]


def test_several_tables():
    a, b = sample(), Tab("other", ["x"], key="second")
    b.add(None)  # None: an empty cell
    assert json.loads(text([a, b], "json")) == {"sample — a title": a.records(), "second": [{"x": None}]}
    assert list(csv.reader(io.StringIO(text([a, b], "csv")))) == [
        ["table", "name", "value", "note", "x"], *(["sample — a title", *r, ""] for r in a.rows), ["second", "", "", "", ""]]
    assert md_tables(text([a, b], "md"))["other"] == [{"x": ""}]


def test_a_row_of_the_wrong_width_is_refused():
    with pytest.raises(ValueError, match="2 cells for 3 columns"):
        sample().add("a", "b")


def test_render_chooses_md_off_a_terminal_and_prints_every_format(capsys):
    console = Console(file=io.StringIO())  # not a terminal
    assert output.chosen(None, console) == "md" and output.chosen("json", console) == "json"
    assert output.chosen(None, Console(file=io.StringIO(), force_terminal=True)) == "table"
    for fmt in ("md", "csv", "json"):
        render(sample(), fmt, console)
        assert capsys.readouterr().out == text(sample(), fmt)
    render(sample(), None, console)
    assert capsys.readouterr().out == text(sample(), "md")


def test_terminal_table_keeps_cells_as_text():
    """Cells are never read as rich markup; a table forced where there is no terminal keeps its natural width."""
    buf = io.StringIO()
    t = sample()
    t.add("long", "4", LONG.strip())
    render(t, "table", Console(file=buf, width=40))
    out = buf.getvalue()
    assert "[red]not markup[/red]" in out and "a|b" in out
    assert LONG.strip() in out  # one line, not folded into 40 columns
    buf = io.StringIO()
    render(t, "table", Console(file=buf, width=60, force_terminal=True))  # a terminal: fits its width
    assert max(len(line) for line in Text.from_ansi(buf.getvalue()).plain.splitlines()) <= 60


# ---- (c) a long cell is never wrapped in md --------------------------------------------------------------
def test_a_long_cell_stays_on_one_line():
    t = Tab("long", ["k", "v"])
    t.add("one", LONG)
    t.add("two", "multi\nline")
    out = text(t, "md")
    assert f"| one | {LONG} |" in out.splitlines()
    assert "| two | multi line |" in out.splitlines()
    assert len(out.splitlines()) == 2 + 2 + 2  # title + blank, header + separator, one line per row


# ---- (b) the CPU commands through the real CLI ----------------------------------------------------------
@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("ATOMFLOW_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.mark.parametrize("fmt", FORMATS)
def test_models(home, capsys, fmt):
    code, out, err = invoke(capsys, "models", *fmt_args(fmt))
    assert code == 0 and quiet(err, fmt)
    parsed = parse(out, fmt)
    catalog = rows_of(parsed, fmt, "catalog", "model catalog")
    assert [r["name"] for r in catalog] == list(CATALOG)
    assert all(r["in store"] == "not fetched" for r in catalog)
    row = {r["name"]: r for r in catalog}["llama-3.2-3b"]
    if fmt == "json":  # the data: numbers, no units
        assert row["layers"] == 28 and row["params"] == 3_212_749_824 and row["fp8 GiB"] == 3.44
    else:
        assert row["layers"] == "28" and row["params"] == ("3212749824" if fmt else "3.213B")
        assert row["fp8 GiB"] == ("3.44" if fmt else "3.44G")
    assert {r["name"]: r["hub"] for r in rows_of(parsed, fmt, "sources")}["llama-3.2-3b"] == \
        "meta-llama/Llama-3.2-3B-Instruct"
    assert rows_of(parsed, fmt, "store", "not in the catalog") == []


TINY = ModelConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def _bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


@pytest.mark.parametrize("fmt", FORMATS)
def test_models_shows_what_is_in_the_store(home, tmp_path, monkeypatch, capsys, fmt):
    """(d) a fetched catalog model with its source and size on disk, the others "not fetched", and store entries the
    catalog does not name (a local import) with theirs."""
    from atomflow_bench.store.fetch import fetch_model
    from atomflow_bench.store.sources.synthetic import make_synthetic

    monkeypatch.setitem(CATALOG, "tiny-test", Preset("tiny-test", "acme/tiny-test", TINY, ("synthetic", "hf")))
    fetched = fetch_model("tiny-test")
    make_synthetic(TINY, tmp_path / "src" / "mine", seed=3)
    local = fetch_model(str(tmp_path / "src" / "mine"))
    # a staging directory whose writer runs (this process) is neither listed nor reported
    (home / "models" / f".half-written.partial-{store._HOST}-{os.getpid()}-x").mkdir()
    code, out, err = invoke(capsys, "models", *fmt_args(fmt))
    assert code == 0 and quiet(err, fmt)
    parsed = parse(out, fmt)
    catalog = {r["name"]: r for r in rows_of(parsed, fmt, "catalog", "model catalog")}
    size = _bytes(fetched)
    assert size > 0 and catalog["tiny-test"]["in store"] == f"synthetic {listing.size_text(size)}"
    assert listing.size_text(size).split()[0] != "0" and listing.size_text(size) != "0 B"
    assert all(r["in store"] == "not fetched" for n, r in catalog.items() if n != "tiny-test")
    [other] = rows_of(parsed, fmt, "store", "not in the catalog")
    assert other["name"] == local.name == "local--mine" and other["source"] == "local"
    assert other["model"] == str((tmp_path / "src" / "mine").resolve())
    assert other["bytes"] == {"json": _bytes(local), "csv": str(_bytes(local)), None: listing.size_text(_bytes(local))}[fmt]


def test_models_reads_the_store_layout_of_fetch(home):
    from atomflow_bench.store.fetch import _plan

    for p in CATALOG.values():
        for src in dict.fromkeys([*p.sources, "synthetic", "hf"]):
            assert listing.catalog_dir(p, src) == _plan(p.name, src).directory


def test_size_units():
    assert [listing.size_text(n) for n in (0, 1023, 1024, 5 << 20, 3 << 30)] == ["0 B", "1023 B", "1.00 KiB", "5.00 MiB",
                                                                         "3.00 GiB"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_baseline_list(capsys, fmt):
    code, out, err = invoke(capsys, "baseline", "list", *fmt_args(fmt))
    assert code == 0 and err == ""
    rows = parse(out, fmt)
    if fmt is None:
        [rows] = rows.values()
    shipped = load_baselines(DEFAULT_DIR)
    assert len(rows) == len(shipped) > 0
    assert [r["source"] for r in rows] == [b["source"] for b in shipped]  # long cells, whole
    def shown(m):  # a fitted line is shown as its formula, one TPOT to 3 decimals
        fit = m.get("tpot_fit_ms")
        return (f"{fit['intercept']:g} + {fit['per_input_token']:g} x {fit['input']} (fitted)" if fit
                else f"{m['tpot_ms']:.3f}")

    if fmt is None:
        assert [r["TPOT ms"] for r in rows] == [shown(b["metrics"]) for b in shipped]
    else:  # the data: the median TPOT, null (json) or empty (csv) for a fitted line
        assert [r["TPOT ms"] for r in rows] == [
            ("" if fmt == "csv" else None) if "tpot_fit_ms" in b["metrics"] else (b["metrics"]["tpot_ms"] if fmt == "json"
                                                        else str(b["metrics"]["tpot_ms"])) for b in shipped]
    if fmt is None:
        assert len([line for line in out.splitlines() if line.startswith("| ")]) == 1 + len(shipped)


def _pair(tmp_path, base: dict, new: dict) -> list[str]:
    d = tmp_path / ("a-directory-with-a-rather-long-name-" * 3)  # long paths in the title: never wrapped
    d.mkdir()
    out = []
    for name, rec in (("base.json", base), ("new.json", new)):
        (d / name).write_text(json.dumps(rec))
        out.append(str(d / name))
    return out


METRICS = ["TPOT median (ms)", "TPOT p10 (ms)", "TPOT p90 (ms)", "tok/s", "achieved bandwidth (GB/s)",
           "% of roofline", "copy bandwidth (GB/s)"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_compare_ok(tmp_path, capsys, fmt):
    base, new = _pair(tmp_path, make_run(2.0, seed=1), make_run(2.02, seed=3))
    code, out, err = invoke(capsys, "compare", base, new, *fmt_args(fmt))
    assert code == 0
    parsed = parse(out, fmt)
    if fmt is None:
        assert err == ""
        [(title, rows)] = parsed.items()
        assert title.startswith(f"compare {base} -> {new}: ok (TPOT +")
    else:  # the verdict, which the table's title holds, is on stderr: one line
        assert err.splitlines() == [err.strip()] and err.startswith("verdict: ok (TPOT +")
        rows = parsed
    assert [r["metric"] for r in rows] == METRICS
    assert set(rows[0]) == {"metric", "baseline", "new", "delta", "delta %"}
    if fmt == "json":
        assert rows[-1]["baseline"] == 3000.0 and rows[0]["delta %"] > 0
    else:
        assert rows[-1]["baseline"] == ("3000" if fmt is None else "3000.0")
        assert float(rows[0]["delta %"].rstrip("%")) > 0


@pytest.mark.parametrize("fmt", ["json", "csv"])
def test_compare_regression_keeps_stdout_parseable(tmp_path, capsys, fmt):
    """The exit codes are the same in every format; with csv/json stdout is the data and the warnings join the
    verdict line on stderr."""
    base, new = _pair(tmp_path, make_run(2.0, seed=1), make_run(2.2, seed=2, copy_gbs=2500.0))
    code, out, err = invoke(capsys, "compare", base, new, *fmt_args(fmt))
    assert code == 1
    assert [r["metric"] for r in parse(out, fmt)] == METRICS
    lines = err.splitlines()
    assert lines[-1].startswith("regression: TPOT median +") and lines[0].startswith("warning: copy bandwidth")
    code, out, err = invoke(capsys, "compare", base, new, "--max-regression", "nan", *fmt_args(fmt))
    assert code == 2 and out == "" and len(err.splitlines()) == 1  # refused: one line, no table


def test_compare_md_warning_after_the_table(tmp_path, capsys):
    base, new = _pair(tmp_path, make_run(2.0, seed=1), make_run(2.02, seed=3, copy_gbs=2500.0))
    code, out, err = invoke(capsys, "compare", base, new)
    assert code == 0 and err == ""
    assert out.splitlines()[-1].startswith("warning: copy bandwidth differs by -16.7%")  # one line, not wrapped
    [rows] = md_tables(out).values()
    assert [r["metric"] for r in rows] == METRICS


@pytest.mark.parametrize("fmt", FORMATS)
def test_doctor(capsys, fmt):
    code, out, err = invoke(capsys, "doctor", "--no-bandwidth", *fmt_args(fmt))
    assert code in (0, 1, 3)  # 3 here (no GPU stack); its table prints all the same
    rows = parse(out, fmt)
    if fmt is None:
        [rows] = rows.values()
    checks = {r["check"]: r for r in rows}
    assert {"atomflow-bench", "NVIDIA driver", "disk"} <= set(checks)
    assert all(set(r) == {"check", "status", "detail"} for r in rows)
    assert checks["atomflow-bench"]["status"] == "ok"


@pytest.mark.parametrize("command", [["models"], ["run"], ["profile"], ["gemv"], ["tune"], ["validate"],
                                     ["baseline", "list"], ["peers"], ["compare"], ["doctor"]])
def test_every_table_command_takes_format(capsys, command):
    code, out, _ = invoke(capsys, *command, "--help")
    assert code == 0 and "--format [table|md|csv|json]" in " ".join(out.split())


# ---- the GPU commands: the real CLI around recorded-style figures ---------------------------------------
def run_record() -> dict:
    rec = make_run(1.5)
    rec.update({"vram_bytes": {"weights": 1 << 30, "kv": 1 << 20, "activations": 1 << 16, "scratch": 1 << 16,
                               "total": (1 << 30) + (1 << 20) + (1 << 17)},
                "launches_per_step": 142, "pdl": True, "load": {"seconds": 1.0},
                "forms": {"forms": "short:ring/l2=8;split:ring/l2=0", "origin": "saved", "path": "/x.json"},
                "attention_buckets": [{"attention": "short <= 416", "lengths": [128, 383], "tokens": 256,
                                       "tpot_ms": 1.5, "gemv": "ring/l2=8"}]})
    return rec


class FakeEngine:
    gpu = {"name": "NVIDIA H100 80GB HBM3", "sms": 132, "l2_bytes": 50 << 20}

    def __init__(self, *a, **k):
        pass


@pytest.fixture
def no_gpu_needed(monkeypatch, tmp_path):
    """require_gpu passes, MODEL resolves to an empty directory, the run context's engine is a stand-in (its forms:
    the `forms` attribute a test may set on the fixture's answer)."""
    import atomflow_bench.gpu.device as device
    import atomflow_bench.gpu.tp.context as tp_context
    from atomflow_bench.measure.context import RunContext

    chosen = {"forms": {"forms": "short:ring/l2=8;split:ring/l2=0", "origin": "default"}}

    def engine(self, *a, **k):
        self.forms = chosen["forms"]
        return FakeEngine()

    monkeypatch.setattr(device, "require_gpu", lambda: None)
    monkeypatch.setattr(tp_context, "resolve_model", lambda spec, console=None, **k: tmp_path)
    monkeypatch.setattr(RunContext, "engine", engine)
    return chosen


@pytest.mark.parametrize("fmt", FORMATS)
def test_run(no_gpu_needed, monkeypatch, capsys, fmt):
    import atomflow_bench.measure.decode as decode

    monkeypatch.setattr(decode, "benchmark", lambda *a, **k: run_record())
    code, out, err = invoke(capsys, "run", "--no-json", *fmt_args(fmt))
    assert code == 0
    parsed = parse(out, fmt)
    run = {r["metric"]: r["value"] for r in rows_of(parsed, fmt, "run", "atomflow-bench run")}
    assert run["GPU"].startswith("NVIDIA H100 80GB HBM3 (sm_90, 132 SMs)")
    assert run["forms"].startswith("short:ring/l2=8;split:ring/l2=0 — a saved tune: short attention")
    pct = run_record()["roofline"]["pct"]  # csv and json: the figure alone; md: with the floor beside it
    assert {"json": lambda v: v == pct, "csv": lambda v: float(v) == pct,
            None: lambda v: v.startswith(f"{pct:.1f}%") and v.endswith("ms = bytes / copy bandwidth)")}[fmt](
        run["% of roofline"])
    comparison = rows_of(parsed, fmt, "comparison", "comparison")
    assert comparison[0]["engine"] == "atomflow-bench 0.1.0" and comparison[0]["source"] == "this run"
    assert {r["GPU"] for r in comparison[1:]} == {"NVIDIA GeForce RTX 5060 Ti"}  # the shipped baselines
    assert all(r.get("speedup (same GPU)") == {"json": None, "csv": None, None: "— (different GPU)"}[fmt]
               for r in comparison[1:])
    if fmt is None:  # a wide row on one line: the whole forms explanation
        from atomflow_bench.measure.run_record import forms_text

        assert (f"| forms | short:ring/l2=8;split:ring/l2=0 — a saved tune: "
                f"{forms_text('short:ring/l2=8;split:ring/l2=0')} |") in out.splitlines()


@pytest.mark.parametrize("fmt", FORMATS)
def test_run_writes_its_results_path_beside_the_tables(no_gpu_needed, monkeypatch, tmp_path, capsys, fmt):
    import atomflow_bench.measure.decode as decode

    monkeypatch.setattr(decode, "benchmark", lambda *a, **k: run_record())
    js = tmp_path / "r.json"
    code, out, err = invoke(capsys, "run", "--json", js, *fmt_args(fmt))
    assert code == 0 and js.is_file()
    assert f"results: {js}" in (err if fmt else out)
    parse(out, fmt)  # still parses: in csv/json the path went to stderr


def profile_record() -> dict:
    return {"context": 128, "steps": 20, "kernel_sum_us": 2672.6, "graph_step_us": 1786.1, "idle_gap_us": -886.5,
            "copy_bandwidth_gbs": {"median": 2994.0},
            "rows": [{"kernel": "gemv fp8 wgu 16384x3072", "pct": 25.2, "count": 28, "mean_us": 23.97,
                      "us_per_step": 672.4, "gbs": 2167.0, "pct_of_copy": 72.4},
                     {"kernel": "embed_lookup", "pct": 0.1, "count": 1, "mean_us": 2.0, "us_per_step": 2.0,
                      "gbs": None, "pct_of_copy": None}],
            "forms": {"length": 129, "attention": "short", "gemv": "ring/l2=8"},
            "attention_graph": {"length": 148, "us_per_launch": {"median": 3.21, "p10": 3.1, "p90": 3.4, "n": 30},
                                "floor_us": 1.5, "x_floor": 2.14, "l2_cold": False},
            "role_marginals": {"length": 148, "step_us": {"median": 1790.0, "p10": 1785.0, "p90": 1795.0},
                               "rows": [{"role": "wgu", "count": 28, "step_without_us": {"median": 1100.0},
                                         "saved_us": 690.0, "saved_us_per_launch": 24.64, "floor_us": 560.0,
                                         "excess_us": 130.0}],
                               "sum_saved_us": 1700.0, "floor_us": 1100.0}}


@pytest.mark.parametrize("fmt", FORMATS)
def test_profile(no_gpu_needed, monkeypatch, capsys, fmt):
    import atomflow_bench.measure.context as context

    asked = []
    monkeypatch.setattr(context, "profile_step", lambda *a, **k: profile_record())
    monkeypatch.setattr(context, "prefill_fields", lambda eng, n, copy: asked.append((n, copy)) or
                        {"prefill": prefill_breakdown_record()})
    code, out, err = invoke(capsys, "profile", "--prompt-tokens", "613", *fmt_args(fmt))
    assert code == 0 and quiet(err, fmt)
    assert asked == [(613, 2994.0)]  # the prompt asked for, the copy bandwidth of the decode profile
    parsed = parse(out, fmt)
    kernels = rows_of(parsed, fmt, "profile", "decode step profile")
    [att] = rows_of(parsed, fmt, "attention", "attention alone")
    prefill = rows_of(parsed, fmt, "prefill", "prefill chunk profile")
    assert [r["role"] for r in prefill] == ["embed", "attn_norm", "qkv", "rope_kv", "attention", "o_proj", "mlp_norm",
                                            "gate_up", "swiglu", "down", "lm_head"]
    assert prefill[2]["µs"] == {"json": 12.0, "csv": "12.0", None: "12.0"}[fmt]
    if fmt == "json":  # the data: numbers, no units
        assert kernels[0] == {"kernel": "gemv fp8 wgu 16384x3072", "% of step": 25.2, "count/step": 28,
                              "mean µs": 23.97, "µs/step": 672.4, "GB/s": 2167.0, "% copy BW": 72.4}
        assert kernels[1]["GB/s"] is None
        assert rows_of(parsed, fmt, "roles")[0]["role adds (µs)"] == 690.0
        assert att == {"length": 148, "µs per layer": 3.21, "p10-p90 µs": [3.1, 3.4], "KV floor µs": 1.5,
                       "x the floor": 2.14, "DRAM": "caches fit in L2: not a DRAM figure"}
    elif fmt == "csv":  # several tables: a row keeps its table's cells, an empty one (None) left out
        assert kernels[0]["% copy BW"] == "72.4" and "GB/s" not in kernels[1]
        assert att["p10-p90 µs"] == "[3.1, 3.4]" and att["x the floor"] == "2.14"
    else:
        assert kernels[0] == {"kernel": "gemv fp8 wgu 16384x3072", "% of step": "25.2", "count/step": "28",
                              "mean µs": "23.97", "µs/step": "672.4", "GB/s": "2167", "% copy BW": "72"}
        assert kernels[1]["GB/s"] == "-"
        assert rows_of(parsed, fmt, "roles", "what each role adds")[0]["role adds (µs)"] == "690.0"
        assert att == {"length": "148", "µs per layer": "3.21", "p10-p90 µs": "3.10-3.40", "KV floor µs": "1.50",
                       "x the floor": "2.14x", "DRAM": "caches fit in L2: not a DRAM figure"}
    if fmt is None:  # the captions, whole, on their line
        assert ("sum of kernels (each alone, launch latency included) 2672.6 µs; graph step 1786.1 µs; overlap: the "
                "graph step is shorter than the kernels one by one by 886.5 µs; copy bandwidth 2994 GB/s; the step at "
                "length 129: short attention, layer GEMVs ring/l2=8") in out.splitlines()


def prefill_breakdown_record() -> dict:
    from test_prefill_profile import breakdown

    return breakdown()


def test_profile_prompt_defaults_to_the_context(no_gpu_needed, monkeypatch, capsys):
    import atomflow_bench.measure.context as context

    asked = []
    monkeypatch.setattr(context, "profile_step", lambda *a, **k: profile_record())
    monkeypatch.setattr(context, "prefill_fields", lambda eng, n, copy: asked.append(n) or
                        {"prefill": None, "prefill_note": "no prefill breakdown: a reason"})
    code, out, err = invoke(capsys, "profile", "--ctx", "96", "--format", "json")
    assert code == 0 and asked == [96]
    assert json.loads(out)["prefill"] == [] and "note: no prefill breakdown: a reason" in err


def gemv_record() -> dict:
    return {"rows": [{"role": "wgu", "format": "fp8", "rows": 16384, "k": 3072, "bytes": 50_724_864,
                      "us": {"median": 20.5, "p10": 20.1, "p90": 21.0}, "gbs": 2474.4, "pct_of_copy": 82.6,
                      "isolated_ceiling_pct": 88.0, "chained_us": {"median": 18.2}, "chained_gbs": 2787.1,
                      "chained_pct_of_copy": 93.1}],
            "copy_bandwidth_gbs": {"median": 2994.0}, "l2_rotation_bytes": 200 << 20, "chained_pdl": True,
            "empty_launch_us": {"median": 2.31}}


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv(monkeypatch, capsys, fmt):
    import atomflow_bench.gpu.device as device
    import atomflow_bench.gpu.ops as ops
    import atomflow_bench.measure.profile as profile

    monkeypatch.setattr(device, "require_gpu", lambda: None)
    monkeypatch.setattr(device, "gpu_info", lambda: dict(FakeEngine.gpu))
    monkeypatch.setattr(ops, "kernel_lib", lambda *a, **k: None)
    monkeypatch.setattr(profile, "gemv_bench", lambda *a, **k: gemv_record())
    code, out, err = invoke(capsys, "gemv", *fmt_args(fmt))
    assert code == 0 and quiet(err, fmt)
    rows = parse(out, fmt)
    if fmt is None:
        [(title, rows)] = rows.items()
        assert title == "GEMV microbenchmark (L2-cold: weights rotate over 200 MiB+)"
    if fmt is None:
        assert rows == [{"GEMV": "wgu", "format": "fp8", "rows x K": "16384x3072", "MB": "50.7",
                         "isolated µs": "20.50", "p10-p90 µs": "20.1-21.0", "GB/s": "2474", "% copy BW": "82.6",
                         "isolated ceiling %": "88", "chained µs": "18.20", "chained GB/s": "2787",
                         "chained % copy BW": "93.1"}]
        return
    want = {"GEMV": "wgu", "format": "fp8", "rows x K": "16384x3072", "MB": 50.724864, "isolated µs": 20.5,
            "p10-p90 µs": [20.1, 21.0], "GB/s": 2474.4, "% copy BW": 82.6, "isolated ceiling %": 88.0,
            "chained µs": 18.2, "chained GB/s": 2787.1, "chained % copy BW": 93.1}
    assert rows == [want if fmt == "json" else {k: json.dumps(v) if isinstance(v, list) else str(v)
                                                for k, v in want.items()}]


@pytest.mark.parametrize("fmt", FORMATS)
def test_tune(no_gpu_needed, monkeypatch, capsys, fmt):
    no_gpu_needed["forms"] = {"forms": "short:ring/l2=8;split:ring/l2=0", "origin": "tuned now", "path": "/tuning/x.json",
              "timed": {"lengths": [192, 384], "step_us": {"short:ws/l2=8": 1530.0, "short:ring/l2=8": 1455.5},
                        "split": {"step_us": {"split:ring/l2=0": 1490.25}}}}
    code, out, err = invoke(capsys, "tune", *fmt_args(fmt))
    assert code == 0
    rows = parse(out, fmt)
    if fmt is None:
        [(title, rows)] = rows.items()
        assert title == "tune — llama-3.2-3b fp8, max_seq 384, NVIDIA H100 80GB HBM3"
    step = {"json": [1455.5, 1530.0], "csv": ["1455.5", "1530.0"], None: ["1455.5", "1530.0"]}[fmt]
    assert rows == [{"forms": "short:ring/l2=8", "step µs (best round)": step[0]},
                    {"forms": "short:ws/l2=8", "step µs (best round)": step[1]}]
    notes = err if fmt else out  # csv/json: the other lines on stderr
    assert "chosen: short:ring/l2=8;split:ring/l2=0 (short attention" in notes
    assert "saved: /tuning/x.json" in notes and "split bucket: split:ring/l2=0 1490.2 µs" in notes


# ---- the builders of the torch commands, and the real commands where torch is here -------------------------
def test_peers_table():
    from atomflow_bench.measure.peers import peers_table

    recs = [{"engine": "HF transformers 5 eager fp16", "gpu": "NVIDIA H100 80GB HBM3", "context": 128, "tokens": 64,
             "tpot_ms": {"median": 20.0, "p10": 19.5, "p90": 21.0}, "tok_per_s": 50.0, "bandwidth_gbs": 320.0,
             "same_tokens_as_first_mode": True},
            {"engine": "HF transformers 5 eager fp16", "gpu": "cpu", "context": 4, "tokens": 3,
             "tpot_ms": {"median": 2.0, "p10": 1.5, "p90": 2.5}, "tok_per_s": 500.0, "bandwidth_gbs": 1.0,
             "same_tokens_as_first_mode": False}]
    t = peers_table(recs)
    assert t.records()[0] == {"engine": "HF transformers 5 eager fp16", "device": "NVIDIA H100 80GB HBM3", "ctx": 128,
                              "tokens": 64, "TPOT median ms": 20.0, "p10 ms": 19.5, "p90 ms": 21.0,
                              "tok/s": 50.0, "GB/s": 320.0, "% of spec GB/s": pytest.approx(320 / 33.5),
                              "same tokens": "True"}
    assert t.records()[1]["% of spec GB/s"] is None
    md = md_tables(text(t, "md"))[t.title]
    assert [r["device"] for r in md] == ["NVIDIA H100 80GB HBM3", "cpu"]
    assert [r["% of spec GB/s"] for r in md] == ["10%", "n/a"] and md[0]["p10 ms"] == "19.500"


def validate_result() -> dict:
    probes = [{"name": f"layer {i}", "cos": 0.9999991, "rel_l2": 1.2e-3, "max_abs": 3.4e-3, "worst_pos": 5,
               "pass": i != 2} for i in range(3)]
    return {"model": {"name": "tiny"}, "weights": "fp16", "backend": {"label": "NumPy reference (CPU)"},
            "thresholds": {"cos_min": 0.9999, "rel_max": 0.02, "kl_max": 1e-3}, "probes": probes,
            "truth": {"prompt_ids": [1, 2, 3], "positions": 8},
            "summary": {"probes_pass": 2, "probes_total": 3, "first_fail": "layer 2", "greedy_agree": 4,
                        "greedy_total": 4, "kl_last": 1e-5, "kl_pass": True, "kl_max_over_positions": 2e-5,
                        "pass": False},
            "notes": ["a note with [brackets]"]}


@pytest.mark.parametrize("fmt", FORMATS)
def test_validate_print_result(capsys, fmt):
    from atomflow_bench.validate import print_result

    console = Console(file=sys.stdout)  # as the CLI's: stdout, not a terminal
    print_result(validate_result(), console, fmt)
    out, err = capsys.readouterr()
    notes = err if fmt else out
    assert "2/3 probes PASS  (first FAIL: layer 2)" in notes and "note: a note with [brackets]" in notes
    assert "FAIL — fp16 on NumPy reference (CPU)" in notes
    if fmt:
        rows = parse(out, fmt)
    else:
        rows = md_tables(out)["validate — tiny fp16 vs transformers fp32 (fp16 weight values)"]
        assert "engine: NumPy reference (CPU); worst position per probe" in out.splitlines()
    assert [r["result"] for r in rows] == ["PASS", "PASS", "FAIL"]
    want = {"json": (0.9999991, 1.2e-3, 3.4e-3, 5), "csv": ("0.9999991", "0.0012", "0.0034", "5"),
            None: ("0.9999991", "1.20e-03", "3.40e-03", "5")}[fmt]
    assert rows[0] == {"probe": "layer 0", **dict(zip(["cos (min)", "rel L2", "max|diff|", "pos"], want)),
                       "threshold": "≥0.9999/≤0.02", "result": "PASS"}


@pytest.mark.parametrize("fmt", FORMATS)
def test_validate_print_quality(capsys, fmt):
    from atomflow_bench.validate import print_quality

    q = {"model": {"name": "tiny"}, "text": {"tokens": 120}, "backend": {"label": "NumPy reference (CPU)"},
         "fp16": {"perplexity": 12.5, "top1_next_token": 0.41}, "fp8": {"perplexity": 12.7, "top1_next_token": 0.40},
         "ppl_ratio": 1.016, "top1_agreement": 0.95, "mean_kl_fp16_fp8": 2e-3, "max_kl_fp16_fp8": 4e-2,
         "bounds": {"ppl_ratio_max": 1.05, "top1_min": 0.9, "mean_kl_max": 0.01},
         "checks": {"ppl_ratio": True, "top1_agreement": True, "mean_kl": True}, "pass": True, "note": None}
    print_quality(q, Console(file=sys.stdout), fmt)
    out, err = capsys.readouterr()
    rows = parse(out, fmt)
    if fmt is None:
        [rows] = rows.values()
    assert [r["metric"] for r in rows][:2] == ["perplexity", "top-1 = next token"]
    assert rows[0]["result"] == "PASS" and rows[1]["result"] == ""
    assert rows[0]["fp8"] == {"json": 12.7, "csv": "12.7", None: "12.7000"}[fmt]
    assert rows[2]["fp16"] == {"json": None, "csv": "", None: ""}[fmt]  # a figure of fp8 alone
    assert "PASS" in (err if fmt else out.splitlines()[-1])


@pytest.mark.parametrize("fmt", ["json", None])
def test_peers_cli_on_cpu(tiny_llama_dir, capsys, fmt):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    code, out, err = invoke(capsys, "peers", tiny_llama_dir, "--device", "cpu", "--modes", "eager", "--ctx", "4",
                            "--tokens", "3", "--repeats", "1", *fmt_args(fmt))
    assert code == 0
    rows = parse(out, fmt)
    if fmt is None:
        [rows] = rows.values()
    [row] = rows
    assert row["device"] == "cpu" and row["ctx"] == {"json": 4, None: "4"}[fmt]
    assert row["% of spec GB/s"] == {"json": None, None: "n/a"}[fmt]


@pytest.fixture(scope="module")
def tiny_truth(tiny_llama_dir, tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    from atomflow_bench.validate.truth import generate_truth

    d = tmp_path_factory.mktemp("tiny-truth-output") / "truth"
    generate_truth(tiny_llama_dir, d, prompt="w5 w17 w42", steps=3, device="cpu")
    return d


@pytest.mark.parametrize("fmt", FORMATS)
def test_validate_cli(tiny_llama_dir, tiny_truth, capsys, fmt):
    """The real `validate` on the NumPy reference: the probe table on stdout (alone with csv/json), the verdict
    lines beside it (on stderr with csv/json)."""
    code, out, err = invoke(capsys, "validate", tiny_llama_dir, "--backend", "numpy", "--weights", "fp16",
                            "--truth", tiny_truth, *fmt_args(fmt))
    assert code == 0, out + err
    rows = parse(out, fmt)
    if fmt is None:
        [rows] = rows.values()
    assert rows and all(r["result"] == "PASS" for r in rows)
    assert f"{len(rows)}/{len(rows)} probes PASS" in (err if fmt else out)


def test_marginal_table_names_whose_step_it_took_apart():
    """`profile --tp` takes apart the rank's step without its exchanges: the table's title says so; a one-GPU profile's
    title is unchanged."""
    from atomflow_bench.measure.profile import marginal_table

    p = profile_record()
    assert marginal_table(p).title == "what each role adds to the graph step (left out of the graph; length 148)"
    p["role_marginals"]["step"] = "rank 0's step without its exchanges (tp path local)"
    assert marginal_table(p).title.endswith("length 148; rank 0's step without its exchanges (tp path local))")
