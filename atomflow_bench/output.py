"""Tables for people and for machines: one way every command prints a table.

`--format table` draws a rich table sized to the terminal; `md` a GitHub markdown table (one row per line, never
wrapped); `csv` (one header line; when a command prints several tables, one CSV whose first column `table` names
each row's table and whose columns are the union of theirs); `json` (a list of objects, one per row, keyed by the
column names; an object of such lists, keyed by each table's `key`, when a command prints several). Without --format:
`table` on a terminal, `md` when stdout is not one (a pipe, a file, a CI log), so a table never wraps there.

Cells are plain text (never rich markup) or a `Num`: a number (or None) with the text people see ("2.30G", "86.0%",
"— (ours)"); csv and json print its number (json null, csv empty for None), tables and markdown its text. A cell
showing two numbers ("20.1-21.0", "320 / 3350 = 10%") holds both: a list in json, that list as JSON text in csv.
Styles (colour, bold) are kept beside the cells and drawn only on a terminal. With csv and json, stdout holds the
data alone: a command's other lines (notes, warnings, the tables' captions, "results: <path>") go to stderr
(`notes_console`).
"""
from __future__ import annotations

import csv
import io
import json
import os
import signal
import sys
from dataclasses import dataclass, field

import click
from rich.console import Console

FORMATS = ("table", "md", "csv", "json")
MACHINE = ("csv", "json")


class PipeClosed(BaseException):
    """The reader of stdout or stderr has gone (`atomflow-bench models | head -0`): the CLI ends as a tool killed by
    SIGPIPE does (cli.main), not through click's or rich's own "exit 1". A BaseException, as KeyboardInterrupt is:
    the handlers that turn any failure into a line (compare's gate, a sweep's cell) have no reader to tell."""


class Out(Console):
    """The CLI's rich console: a closed pipe raises PipeClosed instead of rich's silent exit 1."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise PipeClosed()


@dataclass(frozen=True)
class Num:
    """A numeric cell: `value` for csv and json (int, float or None; a tuple of them where the cell shows several),
    `text` for people."""

    value: float | int | tuple | None
    text: str

    def __str__(self) -> str:
        return self.text


def num(v, spec: str = "", suffix: str = "", none: str = "—", prefix: str = "") -> Num:
    """Num(v, prefix + format(v, spec) + suffix), or Num(None, none) when v is None."""
    return Num(None, none) if v is None else Num(v, f"{prefix}{format(v, spec)}{suffix}")


def span(lo, hi, spec: str = "", sep: str = "-", none: str = "") -> Num:
    """Two numbers in one cell (a p10-p90 range): Num((lo, hi), lo + sep + hi), or Num(None, none) without them."""
    if lo is None or hi is None:
        return Num(None, none)
    return Num((lo, hi), f"{format(lo, spec)}{sep}{format(hi, spec)}")


@dataclass
class Tab:
    """A table as data: a title, column names, rows of cells (str, numbers or None), an optional caption."""

    title: str
    columns: list[str]
    rows: list[list] = field(default_factory=list)
    caption: str = ""
    right: tuple = ()  # columns aligned right (numbers): on a terminal and in markdown
    key: str = ""  # its name in --format json when a command prints several tables (default: the title)
    header: bool = True  # whether the terminal table shows the column names (md, csv and json always name them)
    title_style: str = ""  # rich style of the title, terminal only
    # rich styles, terminal only: (row index, None) a row, (None, column) a column, (row index, column) a cell
    styles: dict = field(default_factory=dict)

    def add(self, *cells, style: str = "", cell_styles: dict | None = None) -> None:
        """Append a row; `style` styles the whole row, `cell_styles` {column: style} single cells (terminal only)."""
        if len(cells) != len(self.columns):
            raise ValueError(f"{self.title}: {len(cells)} cells for {len(self.columns)} columns")
        i = len(self.rows)
        self.rows.append(list(cells))
        if style:
            self.styles[(i, None)] = style
        for col, s in (cell_styles or {}).items():
            if col not in self.columns:
                raise ValueError(f"{self.title}: no column {col!r}")
            if s:
                self.styles[(i, col)] = s

    def records(self) -> list[dict]:
        """The rows as objects keyed by the column names (what --format json prints; a Num as its number)."""
        return [dict(zip(self.columns, map(_value, r))) for r in self.rows]


def format_option(f):
    """The --format option of a command that prints tables."""
    return click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
                        help="table (a terminal), md (markdown: the default when stdout is not a terminal), csv, "
                             "json (one object per row); csv and json give numbers without units and send every "
                             "other line to stderr")(f)


def chosen(fmt: str | None, console) -> str:
    return fmt or ("table" if console.is_terminal else "md")


def is_machine(fmt: str | None, console) -> bool:
    return chosen(fmt, console) in MACHINE


def notes_console(fmt: str | None, console):
    """Where a command prints its lines other than tables: `console` for table and md, a stderr console for csv
    and json (stdout then holds only the data)."""
    if not is_machine(fmt, console):
        return console
    return Out(stderr=True, soft_wrap=True)


def _cell(v) -> str:
    return "" if v is None else str(v)


def _value(v):
    """A cell as data: a Num's number, anything else as it is."""
    return v.value if isinstance(v, Num) else v


def _data_text(v) -> str:
    """A cell's data as csv text: a tuple of numbers as its JSON list, None as nothing."""
    return json.dumps(list(v)) if isinstance(v, tuple) else _cell(v)


def _csv_cell(v) -> str:
    return _data_text(_value(v))


def machine_notes(tabs) -> list[str]:
    """The lines of `tabs` that csv and json leave out of stdout: each table's caption."""
    return [" ".join(t.caption.split()) for t in _as_list(tabs) if t.caption]


def _md(v) -> str:
    return " ".join(_cell(v).replace("\\", "\\\\").replace("|", "\\|").splitlines())


def _as_list(tabs) -> list[Tab]:
    return [tabs] if isinstance(tabs, Tab) else list(tabs)


def text(tabs, fmt: str) -> str:
    """One or more tables as md, csv or json text (what `render` prints for those formats)."""
    tabs = _as_list(tabs)
    if fmt == "json":
        data = [t.records() for t in tabs]
        return json.dumps(data[0] if len(data) == 1 else {(t.key or t.title): d for t, d in zip(tabs, data)},
                          indent=1, default=str, ensure_ascii=False) + "\n"
    out = io.StringIO()
    if fmt == "csv":
        w = csv.writer(out, lineterminator="\n")
        if len(tabs) == 1:
            w.writerow(tabs[0].columns)
            w.writerows([[_csv_cell(c) for c in r] for r in tabs[0].rows])
            return out.getvalue()
        cols = list(dict.fromkeys(c for t in tabs for c in t.columns))  # one header: every table's columns
        w.writerow(["table", *cols])
        for t in tabs:
            for rec in t.records():
                w.writerow([t.key or t.title, *(_data_text(rec.get(c)) for c in cols)])
        return out.getvalue()
    for i, t in enumerate(tabs):
        if i:
            out.write("\n")
        if fmt == "md":
            if t.title:
                out.write(f"**{_md(t.title)}**\n\n")
            out.write("| " + " | ".join(map(_md, t.columns)) + " |\n")
            out.write("|" + "|".join("---:" if c in t.right else "---" for c in t.columns) + "|\n")
            for r in t.rows:
                out.write("| " + " | ".join(map(_md, r)) + " |\n")
            if t.caption:
                out.write(f"\n{t.caption}\n")
        else:
            raise ValueError(f"format {fmt!r}: not one of md, csv, json")
    return out.getvalue()


def _longest_word(s: str) -> int:
    from rich.cells import cell_len

    return max((cell_len(w) for w in s.split()), default=0)


def word_widths(t: Tab) -> list[int]:
    """Each column's narrowest width that breaks no word (its longest word, the name's included)."""
    return [max([_longest_word(c) if t.header else 0] + [_longest_word(_cell(r[i])) for r in t.rows])
            for i, c in enumerate(t.columns)]


def fits(t: Tab, width: int) -> bool:
    """Whether `t` fits `width` columns wrapping its cells only between words (rich's box: a border and a space
    either side of every column)."""
    return sum(word_widths(t)) + 3 * len(t.columns) + 1 <= width


def rich_table(t: Tab, width: int | None = None):
    """`t` as a rich Table (cells as plain Text: brackets in them are never markup). Given the terminal's `width`:
    columns never narrower than their longest word, and, where that cannot fit, one block of "column value" lines
    per row (`vertical`)."""
    from rich.table import Table
    from rich.text import Text

    if width is not None and not fits(t, width):
        return vertical(t, width)
    rt = Table(title=Text(t.title, style=t.title_style) if t.title else None,
               caption=Text(t.caption) if t.caption else None, title_justify="left", caption_justify="left",
               show_header=t.header)
    mins = word_widths(t) if width is not None else [None] * len(t.columns)
    for c, m in zip(t.columns, mins):
        rt.add_column(c, justify="right" if c in t.right else "left", overflow="fold",
                      style=t.styles.get((None, c), ""), min_width=m)
    for i, r in enumerate(t.rows):
        rt.add_row(*(Text(_cell(v), style=t.styles.get((i, c), "")) for c, v in zip(t.columns, r)),
                   style=t.styles.get((i, None)))
    return rt


def vertical(t: Tab, width: int):
    """`t` for a terminal `width` columns wide, too narrow for its columns: each row a block of lines, the column's
    name, then its value (wrapped between words; the names give way first), a rule between rows."""
    from rich.table import Table
    from rich.text import Text

    rt = Table(title=Text(t.title, style=t.title_style) if t.title else None,
               caption=Text(t.caption) if t.caption else None, title_justify="left", caption_justify="left",
               show_header=False)
    from rich.cells import cell_len

    # the names take their whole width where the longest word of the values still fits beside them
    names = max(map(_longest_word, t.columns), default=1)
    values = max((_longest_word(_cell(v)) for r in t.rows for v in r), default=1)
    key = max(names, min(max(map(cell_len, t.columns), default=1), width - 7 - values))
    rt.add_column(style="bold", overflow="fold", width=key)
    rt.add_column(overflow="fold", width=max(1, width - 7 - key))
    for i, r in enumerate(t.rows):
        for j, (c, v) in enumerate(zip(t.columns, r)):
            rt.add_row(Text(c), Text(_cell(v), style=t.styles.get((i, c), "") or t.styles.get((None, c), "")),
                       style=t.styles.get((i, None)), end_section=j == len(r) - 1)
    return rt


def render(tabs, fmt: str | None, console) -> None:
    """Print one or more tables in the chosen format (json: one list per table, or the list when there is one)."""
    tabs = _as_list(tabs)
    fmt = chosen(fmt, console)
    if fmt != "table":
        click.echo(text(tabs, fmt), nl=False)
        if fmt in MACHINE:  # the captions are notes: beside the data, on stderr
            for line in machine_notes(tabs):
                click.echo(f"note: {line}", err=True)
        return
    for i, t in enumerate(tabs):
        if i:
            console.print()
        # a terminal table fits the terminal, breaking no word (vertical where its columns cannot fit); asked for
        # where there is none (a pipe, a file), it is drawn at its natural width, never squeezed into 80 columns
        if console.is_terminal:
            console.print(rich_table(t, console.width))
            continue
        rt = rich_table(t)
        width = console.width
        try:
            console.width = max(width, console.measure(rt, options=console.options.update(width=10_000)).maximum)
            console.print(rt)
        finally:
            console.width = width


class PipeAwareGroup(click.Group):
    """A click group that ends as `pipe_closed` does when its reader has gone."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except BrokenPipeError:  # before click's own catch, which exits 1
            raise PipeClosed() from None


def pipe_closed() -> None:
    """End as standard tools do when their reader has gone (`| head`): killed by SIGPIPE, without a word (the
    handler is the default only now: a socket's closed peer stays an error, not a silent death)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        for stream in (sys.stdout, sys.stderr):
            os.dup2(devnull, stream.fileno())  # nothing left to flush at exit into the closed pipe
    except (OSError, ValueError):
        pass
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGPIPE)
    sys.exit(128 + signal.SIGPIPE)  # where the signal cannot end the process
