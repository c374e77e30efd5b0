"""How long work tells its user what it does. The runtime speaks through a Reporter; the CLI's
prints (cli/output.py), a library caller's or a server's may log or say nothing."""

from __future__ import annotations

from contextlib import contextmanager


class Reporter:
    """Says nothing: what a library caller gets unless it passes its own."""

    def info(self, text: str) -> None:
        """A line about what is happening (stderr, in the CLI)."""

    def note(self, text: str) -> None:
        """Something the user may want to act on."""

    def detail(self, text: str) -> None:
        """A line only a verbose run shows (the CLI's --verbose): what holds on every run."""

    @contextmanager
    def progress(self, title: str):
        """Yields a callback (what, done, total) for a job of steps."""
        yield lambda what, done, total: None

    @contextmanager
    def working(self, title: str):
        """Shown while the block runs; yields a callback status(detail) for how far it got."""
        yield lambda detail: None
