"""Errors the CLI turns into one line: exit code 2 for a UsageError, 1 for any other."""


class NervaError(Exception):
    """A runtime or input error the user can act on; its message is the whole report."""


class BadInput(NervaError):
    """A source, store file or option that is malformed; the message names the file."""


class UsageError(BadInput):
    """The command line itself is wrong: a flag's value out of its range or choices, or two flags
    that contradict each other, what no model, file or network would change. cli.app.main exits 2
    for it, as click does for its own usage errors (a BadInput, so a server that checks a
    request's field with the same code still answers 400)."""


class NotInStore(NervaError):
    """A model reference the store has no entry for (as opposed to one whose entry is broken)."""


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised where nerva's process is, as Ctrl-C raises KeyboardInterrupt, so
    every `finally` runs (a conversion's temporary directory goes); cli.app.main then dies of the
    signal. A BaseException: no `except Exception` takes it for an error to report."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def read_json(path) -> dict:
    """A JSON file, or BadInput naming it: the one way the package reads config-like files."""
    import json

    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise BadInput(f"{path}: missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadInput(f"{path}: not valid JSON ({e})") from None


def writable_file(path, flag: str):
    """`path` (expanded), or BadInput naming the flag and the path where no file can be written
    there: checked before the long work (loading a model), without creating the file."""
    import os
    from pathlib import Path

    where = Path(path).expanduser()
    if where.is_dir():
        why = "is a directory"
    elif not where.parent.is_dir():
        why = f"no directory {where.parent}"
    elif not os.access(where if where.exists() else where.parent, os.W_OK):
        why = "permission denied"
    else:
        return where
    raise BadInput(f"{flag} {path}: {why}")
