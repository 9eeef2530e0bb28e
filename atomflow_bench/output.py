"""Tables for people and for machines: one way every command prints a table.

`--format table` draws a rich table sized to the terminal; `md` a GitHub markdown table; `csv`; `json` (a list of
objects, one per row, keyed by the column names). Without --format: `table` on a terminal, `md` when stdout is not
one (a pipe, a file, a CI log), so a table never wraps into narrow cells there.
"""
from __future__ import annotations

import csv
import json
import sys
from dataclasses import dataclass, field

import click

FORMATS = ("table", "md", "csv", "json")


@dataclass
class Tab:
    """A table as data: a title, column names, rows of cells (str, numbers or None), an optional caption."""

    title: str
    columns: list[str]
    rows: list[list] = field(default_factory=list)
    caption: str = ""
    right: tuple = ()  # columns aligned right in the terminal table (numbers)

    def add(self, *cells) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"{self.title}: {len(cells)} cells for {len(self.columns)} columns")
        self.rows.append(list(cells))


def format_option(f):
    """The --format option of a command that prints tables."""
    return click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
                        help="table (a terminal), md (markdown: the default when stdout is not a terminal), csv, "
                             "json (one object per row)")(f)


def chosen(fmt: str | None, console) -> str:
    return fmt or ("table" if console.is_terminal else "md")


def _cell(v) -> str:
    return "" if v is None else str(v)


def render(tabs, fmt: str | None, console) -> None:
    """Print one or more tables in the chosen format (json: one list per table, or the list when there is one)."""
    tabs = [tabs] if isinstance(tabs, Tab) else list(tabs)
    fmt = chosen(fmt, console)
    if fmt == "json":
        data = [[dict(zip(t.columns, r)) for r in t.rows] for t in tabs]
        click.echo(json.dumps(data[0] if len(data) == 1 else {t.title: d for t, d in zip(tabs, data)}, indent=1,
                              default=str))
        return
    for i, t in enumerate(tabs):
        if fmt == "csv":
            if len(tabs) > 1:
                click.echo(f"# {t.title}")
            w = csv.writer(sys.stdout, lineterminator="\n")
            w.writerow(t.columns)
            w.writerows([[_cell(c) for c in r] for r in t.rows])
        elif fmt == "md":
            esc = lambda s: _cell(s).replace("|", "\\|").replace("\n", " ")  # noqa: E731
            click.echo(f"**{t.title}**\n" if t.title else "", nl=False)
            click.echo("| " + " | ".join(map(esc, t.columns)) + " |")
            click.echo("|" + "|".join("---:" if c in t.right else "---" for c in t.columns) + "|")
            for r in t.rows:
                click.echo("| " + " | ".join(map(esc, r)) + " |")
            if t.caption:
                click.echo(f"\n{t.caption}")
        else:
            from rich.table import Table

            rt = Table(title=t.title or None, caption=t.caption or None, title_justify="left")
            for c in t.columns:
                rt.add_column(c, justify="right" if c in t.right else "left", overflow="fold")
            for r in t.rows:
                rt.add_row(*map(_cell, r))
            console.print(rt)
        if i + 1 < len(tabs) and fmt != "json":
            click.echo("")
