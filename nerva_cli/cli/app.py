"""The command line: the typer app and main(). Each group of commands is a module of its own
(store_commands, run_command, topology_command, measure_commands) that parses, calls the runtime
(runtime/open_engine.py and the store) and prints; errors become one line here."""

from __future__ import annotations

import gc
import os
import signal
import sys
from contextlib import contextmanager
from typing import Annotated

import typer

from nerva_cli.errors import NervaError, Terminated, UsageError

app = typer.Typer(
    name="nerva", add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    help="Run LLMs where they don't fit: nerva schedules every block of weights and KV cache "
         "across memory tiers and shows where the time and the bytes went.",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        from nerva_cli import __version__

        print(f"nerva {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: Annotated[bool, typer.Option("--version", "-V", callback=_print_version, is_eager=True,
                                                   help="Print nerva's version and exit.")] = False) -> None:
    pass


_owns_collector = False  # set by main(): nerva's own process, not a test or a library user's


@contextmanager
def long_lived_objects():
    """Building an engine imports numba and makes some 300k objects that live as long as the
    process. The cyclic collector, left alone, scans them hundreds of times while they are made
    (docs/perf/code_figures.md). So nerva's own process makes them with the collector off, then
    freezes them out of its later scans. Nothing compiles in here (numba compiles at a kernel's
    first call, with the collector on: compiling without it held more memory). Elsewhere the
    collector is left as it is: a freeze would keep whatever cyclic garbage the host process has
    not collected yet."""
    if not _owns_collector or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def _terminate(signum, frame) -> None:
    # once: a second signal must not cut the clean-up the first one started
    signal.signal(signum, signal.SIG_IGN)
    raise Terminated(signum)


def main() -> None:
    global _owns_collector
    _owns_collector = True
    # SIGTERM (timeout, systemd, docker) and SIGHUP (a closed terminal) clean up as Ctrl-C does
    caught = {s: signal.signal(s, _terminate) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        app()
    except NervaError as e:  # a bad flag value exits 2, as click's own usage errors do; the rest 1
        from nerva_cli.cli import output

        output.error(str(e))
        sys.exit(2 if isinstance(e, UsageError) else 1)
    except KeyboardInterrupt:
        sys.exit(130)
    except Terminated as e:  # cleaned up: now end by the signal, as whoever sent it expects
        signal.signal(e.signum, signal.SIG_DFL)
        os.kill(os.getpid(), e.signum)
        sys.exit(128 + e.signum)  # the shell's status for it, where the kill did not end the process
    except OSError as e:  # the last net: a filesystem error on a path the user gave is one line naming it
        from nerva_cli.cli import output

        output.error(f"{e.filename}: {e.strerror}" if e.filename else str(e))
        sys.exit(1)
    finally:
        _owns_collector = False
        for s, handler in caught.items():
            signal.signal(s, handler)
        # the process ends: the collections of the interpreter's finalisation skip what it made
        # since the engine's freeze (numba's cache loads, the chat template's jinja2: 0.01 s)
        gc.freeze()


# the command modules register their commands on `app`, in the order `nerva --help` lists them
from nerva_cli.cli import store_commands, run_command, serve_commands, topology_command, measure_commands  # noqa: E402, F401, I001
