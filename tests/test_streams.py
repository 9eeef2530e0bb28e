"""What the real CLI writes to its two streams, run as a user runs it (a subprocess, stdout a pipe): with
--format csv|json stdout is one document of data (numbers as numbers) and every other line is on stderr."""
from __future__ import annotations

import csv
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_runs import make_run

ROOT = Path(__file__).resolve().parents[1]


def cli(*args, env=None, **kw) -> subprocess.CompletedProcess:
    """`atomflow-bench ARGS` in a fresh process, stdout and stderr captured (neither a terminal)."""
    e = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "atomflow_bench.cli", *map(str, args)], capture_output=True,
                          text=True, env=e, timeout=120, **kw)


def test_models_csv_is_one_csv_document(tmp_path):
    p = cli("models", "--format", "csv", env={"ATOMFLOW_HOME": str(tmp_path)})
    assert p.returncode == 0, p.stderr
    assert not any(line.startswith("#") for line in p.stdout.splitlines())
    rows = list(csv.reader(io.StringIO(p.stdout)))
    assert all(len(r) == len(rows[0]) for r in rows) and rows[0][:2] == ["table", "name"]
    assert {r[0] for r in rows[1:]} == {"catalog", "sources"}  # the store table is empty here
    assert "" not in [line for line in p.stdout.splitlines()]  # no blank line between tables
    # the captions are notes: on stderr, never dropped
    assert "note: fp8 = W8A16" in p.stderr and all(line.startswith("note: ") for line in p.stderr.splitlines())


def test_models_json_values_are_numbers(tmp_path):
    p = cli("models", "--format", "json", env={"ATOMFLOW_HOME": str(tmp_path)})
    assert p.returncode == 0, p.stderr
    row = {r["name"]: r for r in json.loads(p.stdout)["catalog"]}["llama-3.2-1b"]
    assert row["layers"] == 16 and row["vocab"] == 128256 and isinstance(row["params"], int)
    assert isinstance(row["fp16 GiB"], float) and isinstance(row["fp8 GiB"], float)


def _pair(tmp_path, base, new):
    (tmp_path / "a.json").write_text(json.dumps(base))
    (tmp_path / "b.json").write_text(json.dumps(new))
    return tmp_path / "a.json", tmp_path / "b.json"


def test_compare_json_says_its_verdict_on_stderr(tmp_path):
    a, b = _pair(tmp_path, make_run(2.0, seed=1), make_run(2.02, seed=3))
    p = cli("compare", a, b, "--format", "json")
    assert p.returncode == 0
    rows = json.loads(p.stdout)
    assert all(isinstance(r[k], float) for r in rows for k in ("baseline", "new", "delta", "delta %"))
    assert p.stderr.startswith("verdict: ok (TPOT +") and len(p.stderr.splitlines()) == 1


def test_compare_peers_json_has_no_unit_strings(tmp_path):
    run = tmp_path / "run.json"
    run.write_text(json.dumps(make_run(2.0)))
    p = cli("compare-peers", run, "--format", "json")
    assert p.returncode == 0, p.stderr
    for r in json.loads(p.stdout):
        for k, v in r.items():
            if k not in ("engine", "format", "GPU", "note", "source"):
                assert v is None or isinstance(v, (int, float)), (k, v)


@pytest.mark.parametrize("args", [["models"], ["models", "--format", "json"], ["baseline", "list", "--format", "table"],
                                  ["baseline", "list", "--format", "csv"], ["compare", "a.json", "b.json"],
                                  ["compare", "a.json", "b.json", "--format", "table"]])
def test_a_closed_pipe_ends_as_with_sigpipe(tmp_path, args):
    """`atomflow-bench ARGS | head -0`: the reader is gone before the first write; the command ends as `cat` does
    there, killed by SIGPIPE (the shell's 141), without a word on stderr."""
    r, w = os.pipe()
    reader = subprocess.Popen(["head", "-c", "0"], stdin=r)
    os.close(r)
    assert reader.wait(timeout=30) == 0  # the read end is closed now: every write gets EPIPE
    e = {**os.environ, "PYTHONPATH": str(ROOT), "ATOMFLOW_HOME": str(tmp_path)}
    _pair(tmp_path, make_run(2.0, seed=1), make_run(2.02, seed=3))
    p = subprocess.run([sys.executable, "-m", "atomflow_bench.cli", *args], stdout=w, stderr=subprocess.PIPE,
                       env=e, timeout=120, cwd=tmp_path)
    os.close(w)
    assert p.returncode == -signal.SIGPIPE and p.stderr == b""
    sh = subprocess.run(["bash", "-c", f"{sys.executable} -m atomflow_bench.cli {' '.join(args)} | head -0; "
                         "echo ${PIPESTATUS[0]}"], capture_output=True, text=True, env=e, timeout=120, cwd=tmp_path)
    assert sh.stdout == "141\n" and sh.stderr == ""


@pytest.mark.parametrize("args, code, says", [
    (["run", "--forms", "garbage"], 2, "--forms"),
    (["compare-peers"], 2, "no files given"),
    (["run", "--tokens", "0"], 2, "'--tokens': 0 is not in the range"),
    (["nosuch"], 2, "No such command 'nosuch'"),
    (["plot"], 2, "Missing argument"),
    (["baseline", "record", "--openai-url", "not-a-url", "--model", "m", "--gpu", "g"], 2, "not an http(s) URL"),
    (["compare", "absent-a.json", "absent-b.json"], 2, "absent-a.json: not found"),
    (["fetch", "d/config.json"], 1, "d/config.json: is a file, not a model directory"),
])
def test_every_error_is_one_line_starting_error(tmp_path, args, code, says):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text("{}")
    p = cli(*args, env={"ATOMFLOW_HOME": str(tmp_path / "home")}, cwd=tmp_path)
    assert p.returncode == code and p.stdout == ""
    assert p.stderr.startswith("error: ") and p.stderr.count("\n") == 1 and says in p.stderr, p.stderr


@pytest.mark.parametrize("args", [["baseline", "list", "--baselines"], ["baseline", "list", "--dir"],
                                  ["compare-peers", "run.json", "--baselines"], ["run", "--baselines"],
                                  ["sweep", "--baselines"]])
def test_a_baselines_directory_that_does_not_exist_is_refused(tmp_path, args):
    """One option name (--baselines) on every command; a directory that is not there is a usage error, never an
    empty table (exit 0) or a run without the comparison asked for."""
    (tmp_path / "run.json").write_text(json.dumps(make_run(2.0)))
    p = cli(*args, tmp_path / "nonexistent", cwd=tmp_path, env={"ATOMFLOW_HOME": str(tmp_path / "home")})
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.startswith("error: ") and p.stderr.count("\n") == 1 and "nonexistent" in p.stderr


def test_baseline_list_takes_baselines(tmp_path):
    p = cli("baseline", "list", "--baselines", ROOT / "baselines", "--format", "json")
    assert p.returncode == 0 and len(json.loads(p.stdout)) > 0 and p.stderr == ""


def on_a_terminal(*args, columns: int, cwd, env=None) -> str:
    """What `atomflow-bench ARGS` draws on a terminal COLUMNS wide (a real pseudo-terminal), as plain text."""
    import pty

    from rich.text import Text

    master, slave = pty.openpty()
    e = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": str(columns), "LINES": "50", "TERM": "xterm",
         **(env or {})}
    p = subprocess.Popen([sys.executable, "-m", "atomflow_bench.cli", *map(str, args)], stdout=slave,
                         stderr=subprocess.PIPE, env=e, cwd=cwd)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert p.wait(timeout=120) == 0, p.stderr.read()
    return Text.from_ansi(out.decode().replace("\r\n", "\n")).plain


def _words_whole(cells, shown: str) -> None:
    """Every word of every cell is on one line of what was drawn: no word is broken across lines."""
    for cell in cells:
        for word in str(cell).split():
            assert word in shown, f"{word!r} is broken:\n{shown}"


@pytest.mark.parametrize("columns", [80, 120])
def test_models_fits_the_terminal_breaking_no_name(tmp_path, columns):
    shown = on_a_terminal("models", columns=columns, cwd=tmp_path, env={"ATOMFLOW_HOME": str(tmp_path / "h")})
    assert max(map(len, shown.splitlines())) <= columns
    data = json.loads(cli("models", "--format", "json", env={"ATOMFLOW_HOME": str(tmp_path / "h")}).stdout)
    _words_whole([r["name"] for r in data["catalog"]] + [r["hub"] for r in data["sources"]], shown)
    _words_whole(["llama-3.2-1b", "llam"], shown)


@pytest.mark.parametrize("columns", [80, 120])
def test_compare_peers_rows_fit_the_terminal(tmp_path, columns):
    (tmp_path / "run.json").write_text(json.dumps(make_run(2.0, model="llama-3.1-8b")))
    shown = on_a_terminal("compare-peers", "run.json", columns=columns, cwd=tmp_path)
    lines = [line for line in shown.splitlines() if not line.startswith("left out: ")]  # notes: prose, one line
    assert max(map(len, lines)) <= columns
    rows = json.loads(cli("compare-peers", "run.json", "--format", "json", cwd=tmp_path).stdout)
    _words_whole([v for r in rows for v in r.values() if isinstance(v, str)], shown)
    assert len(lines) <= 6 + 20 * len(rows)  # a block of at most 20 lines per row, not ~40


def test_generate_prints_the_text_alone_and_unwrapped(tmp_path):
    """Piped, `generate` writes the text as it is, one line however long (COLUMNS=80), and its status line on
    stderr."""
    from test_user_errors import _model

    src = _model(tmp_path / "m", tokenizer=True)
    prompt = " ".join(f"w{i}" for i in range(5, 45))  # 150 characters
    p = cli("generate", src, "--prompt", prompt, "--tokens", "3", env={"COLUMNS": "80",
                                                                      "ATOMFLOW_HOME": str(tmp_path / "h")})
    assert p.returncode == 0, p.stderr
    [line] = p.stdout.splitlines()
    assert line.startswith(prompt) and len(line) > 80
    assert "numpy fp16: " in p.stderr and "prompt +" in p.stderr


# ---- what the CLI says about itself ------------------------------------------------------------------------------
def test_top_level_help_names_every_exit_code_and_completion():
    p = cli("--help")
    text = " ".join(p.stdout.split())
    for code in ("0 ok", "1 error", "2 usage", "3 no usable GPU", "70 internal", "130 interrupted", "143 terminated",
                 "141"):
        assert code in text, code
    assert "_ATOMFLOW_BENCH_COMPLETE=bash_source atomflow-bench" in text


def _complete(tmp_path, line: str) -> list[str]:
    """What bash completion offers for the last word of `line` (click's protocol, as the sourced script asks)."""
    words = line.split(" ")
    p = cli(env={"_ATOMFLOW_BENCH_COMPLETE": "bash_complete", "COMP_WORDS": line, "COMP_CWORD": str(len(words) - 1),
                 "ATOMFLOW_HOME": str(tmp_path)})
    assert p.returncode == 0, p.stderr
    return p.stdout.splitlines()


@pytest.mark.parametrize("command", ["run", "profile", "tune", "gemv", "validate", "fetch", "generate", "peers"])
def test_completion_offers_model_names(tmp_path, command):
    (tmp_path / "models" / "local--mine").mkdir(parents=True)  # a store entry: its name works as MODEL
    (tmp_path / "models" / ".x.partial-1").mkdir()  # a staging directory is not a name
    assert _complete(tmp_path, f"atomflow-bench {command} llama-3.1") == [
        "plain,llama-3.1-8b", "plain,llama-3.1-70b", "plain,llama-3.1-405b"]
    assert _complete(tmp_path, f"atomflow-bench {command} local") == ["plain,local--mine"]
    assert _complete(tmp_path, f"atomflow-bench {command} ./") == ["file,./"]  # a path: the shell completes files


def test_fetch_takes_weights_and_its_old_format_spelling(tmp_path):
    home = {"ATOMFLOW_HOME": str(tmp_path)}
    assert "--weights [fp16|fp8]" in cli("fetch", "--help").stdout and "--format" not in cli("fetch", "--help").stdout
    p = cli("fetch", "smollm2-135m", "--source", "synthetic", "--weights", "fp8", env=home)
    assert p.returncode == 0, p.stderr
    stored = Path(p.stdout.strip().splitlines()[-1].removeprefix("ok "))
    assert stored.parent == tmp_path / "models" and (stored / "model-fp8.safetensors").is_file()
    p = cli("fetch", "smollm2-135m", "--source", "synthetic", "--format", "fp8", env=home)
    assert p.returncode == 0 and "warning: fetch --format is now --weights" in p.stderr


def test_the_no_tokenizer_warning_names_commands_that_exist(tmp_path):
    from atomflow_bench.cli import cli as group
    from test_user_errors import _model

    p = cli("fetch", _model(tmp_path / "notok"), env={"ATOMFLOW_HOME": str(tmp_path / "h")})
    [warning] = [line for line in p.stderr.splitlines() if "no tokenizer" in line]
    named = warning.split("; ", 1)[1].removesuffix(" work on token ids").replace(" and ", ", ").split(", ")
    assert named and all(n in group.commands for n in named), named
