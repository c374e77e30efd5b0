"""One place that decides how things are shown: rich on a terminal, plain when piped."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager

from nerva_cli.units import human_bytes  # noqa: F401  (the commands format sizes through output)


def _console(name: str):
    """`out` or `err`, the rich Console of stdout or stderr, made at its first use: a run that
    prints nothing through them (`run -p` answers on sys.stdout) does not import rich
    (docs/perf/startup_epyc_zen3.md). Text that holds the user's words (model names, paths,
    prompts) is printed as written: emoji codes off (`tiny:banana:` became a banana), markup
    escaped (`escape`) or off where a line has none."""
    console = globals().get(name)
    if console is None:
        from rich.console import Console

        console = globals()[name] = Console(stderr=name == "err", highlight=False, soft_wrap=True, emoji=False)
    return console


def escape(text: str) -> str:
    from rich.markup import escape as rich_escape

    return rich_escape(text)


def __getattr__(name: str):
    if name in ("out", "err"):  # output.out, output.err
        return _console(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def columns(header: tuple[str, ...], rows) -> None:
    """A table with a header: rich on a terminal, long cells wrapped; piped, plain lines of cells
    padded to their column's widest, never cut (`list | awk '{print $1}'` took a name cut to an
    ellipsis)."""
    rows, out = [tuple(map(str, r)) for r in rows], _console("out")
    if not out.is_terminal:
        widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
        for r in (header, *rows):
            out.print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip(), markup=False)
        return
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, header_style="bold")
    for name in header:
        table.add_column(name, overflow="fold")
    for r in rows:
        table.add_row(*map(Text, r))
    out.print(table)


def facts(rows) -> None:
    """(name, value) rows: two aligned columns on a terminal, long values wrapped; piped, a
    "name: value" line each, never cut to the pipe's assumed 80 columns."""
    out = _console("out")
    if not out.is_terminal:
        for name, value in rows:
            out.print(f"{name}: {value}", markup=False)
        return
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, show_header=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for name, value in rows:
        table.add_row(Text(name), Text(value))  # as written: a value may hold brackets
    out.print(table)


def note(msg: str) -> None:
    err = _console("err")
    err.print(f"[yellow]note:[/yellow] {escape(msg)}" if err.is_terminal else f"note: {msg}", markup=err.is_terminal)


def info(msg: str) -> None:
    _console("err").print(msg, markup=False)


def error(msg: str) -> None:
    """The one line a refused input gets, as printed (its text may hold brackets)."""
    _console("err").print(f"error: {msg}", markup=False, highlight=False)


@contextmanager
def working(title: str):
    """A spinner with the time elapsed while the block runs, on a terminal, after the title what
    the callback it yields, status(detail), last said; the title once, when piped."""
    err = _console("err")
    if not err.is_terminal:
        err.print(title, markup=False)
        yield lambda detail: None
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn(escape(title) + "{task.description}"), TimeElapsedColumn(), console=err,
                  transient=True) as bar:
        task = bar.add_task("", total=None)
        yield lambda detail: bar.update(task, description=f": {escape(detail)}")


@contextmanager
def step_progress(title: str):
    """Yields a callback (what, done, total); a bar on a terminal, one line per 25% when piped.
    Nothing shows before the first call: a step found done (a cached profile) shows nothing, and
    looks at no console."""
    bar, last = [], [-1]

    def update(what: str, done: int, total: int) -> None:
        err = _console("err")
        if not err.is_terminal:
            quarter = 4 * done // max(total, 1)
            if quarter != last[0]:
                last[0] = quarter
                err.print(f"{title} {done}/{total} {what}", markup=False)
            return
        if not bar:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            bar.append(Progress(TextColumn(f"{title} [bold]{{task.description}}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=err, transient=True))
            bar[0].start()
            bar.append(bar[0].add_task("", total=None))
        bar[0].update(bar[1], description=what, completed=done, total=total)

    try:
        yield update
    finally:
        if bar:
            bar[0].stop()


class CliReporter:
    """The runtime's Reporter (runtime/report.py) on this terminal: lines and notes on stderr, bars
    and spinners where it is a terminal; details only when `verbose` (run --verbose)."""

    info = staticmethod(info)
    note = staticmethod(note)
    progress = staticmethod(step_progress)
    working = staticmethod(working)

    def __init__(self, verbose: bool = False):
        self.verbose = verbose

    def detail(self, text: str) -> None:
        if self.verbose:
            info(text)
