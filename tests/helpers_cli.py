"""The real CLI in-process: `main(args)` with its exit code and what it printed (tests share this)."""
from __future__ import annotations

from atomflow_bench.cli import main


def invoke(capsys, *args) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `atomflow-bench ARGS` run through `main`, as the console script runs it."""
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err
