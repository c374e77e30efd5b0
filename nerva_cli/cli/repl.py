"""The interactive chat of `nerva run`, as ollama's: line editing and a history kept across
chats where Python has readline, \"\"\" around a message of several lines, and slash commands
that change the chat without leaving it. A bad command or a message that cannot fit prints one
error line; the chat goes on."""

from __future__ import annotations

import sys
from dataclasses import replace

from nerva_cli.cli import output
from nerva_cli.errors import NervaError
from nerva_cli.runtime.sampling import SamplingOptions

# ollama's parameter names, each with the type its value is read as
PARAMETERS = {"temperature": float, "top_k": int, "top_p": float, "min_p": float, "repeat_penalty": float,
              "repeat_last_n": int, "seed": int, "num_predict": int, "stop": str}

COMMANDS = (
    ("/set parameter NAME VALUE", f"change a sampling parameter ({', '.join(PARAMETERS)})"),
    ("/set system TEXT", "the system message from the next message on (no TEXT: none)"),
    ("/set format json", "hold answers to JSON: json, a JSON Schema file or '{...}', as --format (/set noformat: not)"),
    ("/set verbose", "the prompt and answer rates, TTFT and stop reason after each answer (/set quiet: not)"),
    ("/show info", "the model, each layer's precision, the context, the backend"),
    ("/show parameters", "the sampling parameters in force"),
    ("/show system", "the system message in force"),
    ("/show template", "the chat template the messages go through"),
    ("/clear", "forget the conversation"),
    ("/bye", "leave (Ctrl-D too)"),
    ('"""', 'begin and end a message of several lines'),
    ("/?", "this list"),
)

BLOCK = '"""'


def read_message(read=input) -> str:
    """One message: a line, or the lines from one that starts with \"\"\" to one that ends with
    it. EOFError at the end of input; KeyboardInterrupt (Ctrl-C) drops a half-typed block."""
    line = read(">>> ")
    if not line.lstrip().startswith(BLOCK):
        return line
    text = line.lstrip()[len(BLOCK):]
    lines = []
    while not text.rstrip().endswith(BLOCK):
        lines.append(text)
        text = read("... ")
    lines.append(text.rstrip()[: -len(BLOCK)])
    return "\n".join(lines).strip("\n")


def chat_loop(session, write, runtime: str, verbose: bool = False, stats_line=str, book=None,
              every: int = 1, ready=None) -> None:
    """`runtime`: the backend and threads, as /show info tells them. `verbose`: stats_line(the
    answer's stats) after each answer, as --verbose or /set verbose asks. `ready`: None, or work
    begun on the engine while the chat waits for its first message (the CLI's warm-up): ready()
    waits for it, raising what it raised, and is called before the engine is touched;
    ready(quiet=True) on leaving."""
    save_history = _line_editing()
    try:
        _loop(session, write, runtime, verbose, stats_line, book, every, ready or (lambda quiet=False: None))
    finally:
        if ready is not None:
            ready(quiet=True)  # its thread is done before the interpreter is
        save_history()


def _loop(session, write, runtime, verbose, stats_line, book, every, ready) -> None:
    output.info("Type a message; /? lists the commands, /bye or Ctrl-D leaves, Ctrl-C stops an answer.")
    while True:
        try:
            text = read_message()
        except EOFError:
            write("\n")
            return
        except KeyboardInterrupt:
            write("\nUse Ctrl-D or /bye to exit.\n")
            continue
        except UnicodeDecodeError:  # a locale whose stdin is strict about UTF-8
            output.error("that line is not UTF-8 text")
            continue
        if not text.strip():
            continue
        try:
            ready()
        except KeyboardInterrupt:  # Ctrl-C while the warm-up ends: the message goes, as in an answer
            write("\n^C\n\n")
            continue
        except NervaError as e:
            output.error(str(e))
            continue
        try:
            if text.lstrip().startswith("/") and "\n" not in text:  # a """ block is always a message
                done = command(session, text.strip(), write, runtime)
                if done == "bye":
                    return
                if done in ("verbose", "quiet"):
                    verbose = done == "verbose"
                continue
            stats = session.answer(text, write=write)
        except NervaError as e:
            output.error(str(e))
            continue
        write("\n\n" if stats.stop_reason != "interrupted" else "\n^C\n\n")
        after_answer(session, stats, verbose, stats_line, book, every)


def after_answer(session, stats, verbose: bool, stats_line, book, every: int) -> None:
    """What follows an answer on stderr: why it stopped where that is the context, its rates
    (--verbose), its ledger (--ledger)."""
    if stats.cut_short:
        output.note(session.cut_short_note(stats))
    elif stats.stop_reason == "context":
        output.note(session.context_note())
    if verbose:
        output.info(stats_line(stats))
    if book is not None:
        book.print_table(output.err, every)
        book.records.clear()


def command(session, line: str, write, runtime: str = "") -> str | None:
    """Runs one slash command; "bye" when the chat should end, "verbose" or "quiet" when the
    answers' stats should follow them or not. NervaError for a bad one."""
    words = line.split()
    head = words[0]
    if head in ("/bye", "/exit", "/quit"):
        return "bye"
    if head in ("/?", "/help"):
        write(_aligned(COMMANDS))
    elif head == "/clear":
        session.clear()
        output.info("chat cleared")
    elif head == "/set" and len(words) >= 2 and words[1] == "system":
        text = line.split(None, 2)[2] if len(words) > 2 else None
        if session.raw:
            raise NervaError("/set system: --raw sends no chat template, so no system message")
        session.set_system(text)
        output.info("system message set" if text else "system message removed")
    elif head == "/set" and len(words) >= 3 and words[1] == "parameter":
        _set_parameter(session, words[2], words[3:])
    elif head == "/set" and len(words) >= 3 and words[1] == "format":
        from nerva_cli.structured.formats import from_flags

        session.format = from_flags(line.split(None, 2)[2].strip(), None)  # refused whole where it is wrong
        output.info(f"answers held to {session.format.describe()}")
    elif head == "/set" and words[1:] == ["noformat"]:
        session.format = None
        output.info("answers free")
    elif head == "/set" and words[1:] in (["verbose"], ["quiet"]):
        output.info("stats after each answer" if words[1] == "verbose" else "no stats after answers")
        return words[1]
    elif head == "/show" and len(words) == 2 and words[1] == "info":
        write(_aligned(info(session, runtime)))
    elif head == "/show" and len(words) == 2 and words[1] == "parameters":
        write(_aligned(parameters(session)))
    elif head == "/show" and words[1:] == ["system"]:
        write(f"{session.system}\n" if session.system else "no system message\n")
    elif head == "/show" and words[1:] == ["template"]:
        template = session.template
        write(f"{template}\n" if template else "no chat template: messages go to the model as they are\n")
    elif head == "/show":
        raise NervaError(f"{line!r}: /show info, parameters, system or template")
    elif head == "/set":
        raise NervaError(f"{line!r}: /set parameter NAME VALUE, /set system TEXT, /set format json, /set noformat, "
                         "/set verbose or /set quiet")
    else:
        raise NervaError(f"unknown command {line!r}: /? lists the commands")
    return None


def _aligned(rows) -> str:
    """(name, text) rows as two columns, the names padded to the longest."""
    width = max(len(k) for k, _ in rows)
    return "".join(f"  {k.ljust(width)}  {v}\n" for k, v in rows)


def _set_parameter(session, name: str, values: list[str]) -> None:
    kind = PARAMETERS.get(name)
    if kind is None:
        raise NervaError(f"/set parameter: unknown parameter {name!r} (known: {', '.join(PARAMETERS)})")
    if name == "stop":
        session.stops = values  # none: no stop strings
        output.info(f"stop set to {values}")
        return
    if len(values) != 1:
        raise NervaError(f"/set parameter {name}: give one value")
    try:
        value = kind(values[0])
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise NervaError(f"/set parameter {name}: {values[0]!r} is not {what}") from None
    if name == "num_predict":
        if value < 1:
            raise NervaError(f"/set parameter num_predict must be >= 1, got {value}")
        session.max_tokens = value
    else:
        try:
            opts = replace(session.opts, **{name: value})  # validated by SamplingOptions
        except NervaError as e:
            raise NervaError(f"/set parameter {name}: {e}") from None
        session.set_options(opts)
    output.info(f"{name} set to {value}")


def parameters(session) -> list[tuple[str, str]]:
    o: SamplingOptions = session.opts
    return [("temperature", f"{o.temperature:g}"), ("top_k", str(o.top_k)), ("top_p", f"{o.top_p:g}"),
            ("min_p", f"{o.min_p:g}"), ("repeat_penalty", f"{o.repeat_penalty:g}"), ("repeat_last_n", str(o.repeat_last_n)),
            ("seed", "random" if o.seed is None else str(o.seed)), ("num_predict", str(session.max_tokens)),
            ("stop", ", ".join(map(repr, session.stops)) or "none"),
            ("format", session.format.describe() if session.format is not None else "none")]


def info(session, runtime: str) -> list[tuple[str, str]]:
    e = session.engine
    if e is None:  # a chat a running server holds (serve/remote_chat.py)
        return session.info_rows(runtime)
    m, cfg = e.model, e.cfg
    plan = e.plan
    rows = [("model", f"{m.name}:{m.variant}  {m.path}"),
            ("architecture", f"{cfg.family}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
                             f"{cfg.num_heads} heads ({cfg.num_kv_heads} KV), vocab {cfg.vocab_size}"),
            ("precision", _precisions(e.layer_precision, cfg.num_layers)),
            ("context", f"{e.n_past} of {e.ctx} tokens in use (model max {cfg.max_context})"),
            ("backend", runtime),
            ("residency", f"{len(plan.resident_layers)} layers resident"
                          + (f", {len(plan.paged_layers)} paged through {plan.slots} slots"
                             if plan.paged_layers else ""))]
    if session.system:
        rows.append(("system", session.system))
    return rows


def _precisions(per_layer: dict[int, str], n_layers: int) -> str:
    """'w4a16 on 11, 28, 29; w4a8 on the other 27', as the run's first line says it."""
    groups: dict[str, list[int]] = {}
    for i, p in sorted(per_layer.items()):
        groups.setdefault(p, []).append(i)
    parts = sorted(groups.items(), key=lambda kv: len(kv[1]))
    if len(parts) == 1:
        text = f"{parts[0][0]} on all {len(parts[0][1])} layers"
    else:
        *small, (most, ids) = parts
        text = "; ".join(f"{p} on {', '.join(map(str, ids))}" for p, ids in small) + f"; {most} on the other {len(ids)}"
    skipped = n_layers - len(per_layer)
    return text + (f"; {skipped} layers skipped (hot-only)" if skipped else "")


HISTORY_LINES = 1000


def _line_editing():
    """Arrow keys for input() and a history kept across chats in $NERVA_HOME/history, where
    Python was built with readline. -> a function that saves the history (a no-op without it)."""
    if not sys.stdin.isatty():
        return lambda: None
    try:
        import readline  # importing it is what turns line editing on
    except ImportError:
        return lambda: None
    from nerva_cli.store.catalog import home

    path = home() / "history"
    readline.set_history_length(HISTORY_LINES)
    try:
        readline.read_history_file(path)
    except OSError:  # none yet, or unreadable: the chat starts with an empty history
        pass

    def save() -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(path)
        except OSError as e:
            output.note(f"{path}: the chat history was not saved ({e.strerror})")

    return save
