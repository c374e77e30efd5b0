"""Errors the CLI turns into one line and exit code 1."""


class NervaError(Exception):
    """A runtime or input error the user can act on; its message is the whole report."""


class BadInput(NervaError):
    """A source, store file or option that is malformed; the message names the file."""
