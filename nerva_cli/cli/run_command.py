"""`nerva run`: one prompt, or a chat as in `ollama run`."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from nerva_cli.cli.app import app, long_lived_objects
from nerva_cli.cli.options import (ActiveFraction, Backend, Ctx, ExpertPolicy, KvCache, Mode, NoProfile, Policy,
                                   Precision, RamBudget, Tau, Threads, VramBudget)
from nerva_cli.errors import NervaError, UsageError, writable_file
from nerva_cli.hardware.machine import configure_threads


@app.command(epilog='Examples: nerva run smollm2-135m -p "Why is the sky blue?" | nerva run smollm2-135m Why is the sky blue? | '
                     'echo "hi" | nerva run smollm2-135m | cat notes.txt | nerva run smollm2-135m summarise this')
def run(
    model: Annotated[str, typer.Argument(help="name[:variant] in the store, a model directory, or a source to pull first (smollm2-135m, a .gguf file, hf.co/USER/REPO[:TAG]).")],
    words: Annotated[Optional[list[str]], typer.Argument(metavar="[PROMPT]...", show_default=False, help="The prompt as ollama takes it: the words after the model, joined by spaces, after the text piped to stdin if any.")] = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="One prompt, answer, exit; stdin is not read. Without it or words: interactive chat (or the prompt from stdin when piped).")] = None,
    raw: Annotated[bool, typer.Option("--raw", help="Send the prompt as is, without the chat template (a model that has none always does).")] = False,
    system: Annotated[Optional[str], typer.Option(help="System message for the chat template.")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Most tokens to generate per answer.")] = 512,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.8,
    top_k: Annotated[int, typer.Option(help="Keep the k most likely tokens (0: all).")] = 40,
    top_p: Annotated[float, typer.Option(help="Keep the smallest set whose probability reaches p.")] = 0.95,
    min_p: Annotated[float, typer.Option(help="Keep tokens whose probability is at least p times the likeliest's (0: off; llama.cpp's default is 0.05).")] = 0.0,
    repeat_penalty: Annotated[float, typer.Option(help="Penalise the last --repeat-last-n tokens (1.0: off).")] = 1.0,
    repeat_last_n: Annotated[int, typer.Option(help="The tokens --repeat-penalty looks back over (0: none).")] = 64,
    seed: Annotated[Optional[int], typer.Option(help="Random seed for sampling.")] = None,
    stop: Annotated[Optional[list[str]], typer.Option(help="Stop when this text appears (repeatable).")] = None,
    answer_format: Annotated[Optional[str], typer.Option("--format", help="Hold every answer to JSON: `json` (any object), a JSON Schema file, or a schema inline ('{...}'). A schema nerva cannot hold to is an error before any token.")] = None,
    grammar: Annotated[Optional[Path], typer.Option("--grammar", help="Hold every answer to a grammar file: Lark (as llguidance reads it) or GBNF (llama.cpp's, rules written `name ::= ...`).")] = None,
    ctx: Ctx = None,
    threads: Threads = None,
    precision: Precision = None,
    tau: Tau = 0.7,
    no_profile: NoProfile = False,
    mode: Mode = "full",
    active_fraction: ActiveFraction = 0.75,
    ram_budget: RamBudget = None,
    vram_budget: VramBudget = None,
    policy: Policy = "ring",
    expert_policy: ExpertPolicy = "lfu",
    kv_cache: KvCache = "f16",
    backend: Backend = "auto",
    no_server: Annotated[bool, typer.Option("--no-server", help="Run in this process even where a `nerva serve` answers at NERVA_HOST (by default a running server answers, its model already loaded, unless a flag here asks for this process's engine: --ledger, --ctx, --backend, --threads, --precision and the residency flags).")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Print the layers' precisions and the load time, then timings after each answer.")] = False,
    ledger: Annotated[bool, typer.Option("--ledger", help="Print the per-token ledger (time per phase, bytes per tier) after each answer.")] = False,
    ledger_every: Annotated[int, typer.Option("--ledger-every", help="With --ledger: show every Nth token (the summary counts all).")] = 1,
    ledger_file: Annotated[Optional[Path], typer.Option("--ledger-file", help="Write the ledger as JSON lines to this file.")] = None,
):
    """Chat with a model (in the chat, /? lists its commands), or answer one prompt (-p)."""
    started = time.perf_counter()
    threads_given = threads is not None
    threads = configure_threads(threads)
    from nerva_cli.cli import output
    from nerva_cli.runtime.chat import ChatSession
    from nerva_cli.runtime.open_engine import open_engine
    from nerva_cli.runtime.options import EngineOptions
    from nerva_cli.runtime.sampling import SamplingOptions

    opts = SamplingOptions(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                           repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, seed=seed)
    if max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {max_tokens}")
    if ledger_every < 1:
        raise UsageError(f"--ledger-every must be >= 1, got {ledger_every}")
    if raw and system is not None:
        raise UsageError("--system goes into the chat template, which --raw leaves out")
    if ledger_file is not None:
        ledger_file = writable_file(ledger_file, "--ledger-file")
    from nerva_cli.structured.formats import from_flags

    fmt = from_flags(answer_format, grammar)  # refused here, before a model loads, where it is wrong
    options = EngineOptions(backend=backend, precision=precision, tau=tau, use_profile=not no_profile, mode=mode,
                            active_fraction=active_fraction, ctx=ctx, threads=threads, ram_budget=ram_budget,
                            vram_budget=vram_budget, policy=policy, expert_policy=expert_policy, kv_cache=kv_cache,
                            decodes=max_tokens > 1)
    if words:
        if prompt is not None:
            raise UsageError(f"give the prompt once: -p or the words after the model, not both ({' '.join(words)!r})")
        prompt = " ".join(words)
        if not sys.stdin.isatty():  # ollama's way: `cat notes.txt | nerva run MODEL summarise this`
            piped = _read_stdin().rstrip()
            prompt = f"{piped}\n\n{prompt}" if piped.strip() else prompt
    elif prompt is None and not sys.stdin.isatty():
        prompt = _read_stdin()
        if not prompt.strip():
            raise NervaError("stdin is not a terminal and held no prompt: pipe text in, or give -p or the words")
    engine_flags = {"--ledger": ledger, "--ledger-file": ledger_file is not None, "--ctx": ctx is not None,
                    "--threads": threads_given, "--precision": precision is not None, "--tau": tau != 0.7,
                    "--no-profile": no_profile, "--mode": mode != "full", "--active-fraction": active_fraction != 0.75,
                    "--ram-budget": ram_budget is not None, "--vram-budget": vram_budget is not None,
                    "--policy": policy != "ring", "--expert-policy": expert_policy != "lfu",
                    "--kv-cache": kv_cache != "f16", "--backend": backend != "auto",
                    "--grammar": grammar is not None}  # ollama's API, the server's, takes no grammar
    remote = None if no_server or any(engine_flags.values()) else _through_server(model, raw, system)
    if remote is not None:
        client, described = remote
        if verbose:
            output.info(f"answered by the nerva server at {client.url}, which holds the model (--no-server: "
                        "this process)")
        from nerva_cli.serve.remote_chat import RemoteChat

        if not raw and not described.get("template"):
            if system is not None:
                raise NervaError(f"{model} has no chat template, so --system has nowhere to go")
            output.note(f"{model} has no chat template: prompts go to it as they are (--raw)")
            raw = True
        session = RemoteChat(client, model, described, opts, max_tokens, raw=raw, system=system, stops=stop or [],
                             fmt=fmt)
        _converse(session, prompt, verbose, f"the nerva server at {client.url}")
        return
    engine, tokenizer = open_engine(model, options, output.CliReporter(verbose), building=long_lived_objects)
    if verbose:  # ollama's "load duration": model, profile, tokenizer, arena, any kernels compiled ahead
        output.info(f"loaded in {time.perf_counter() - started:.2f} s")
    if not raw and not tokenizer.template:  # a base model: ollama sends its prompt as is too
        if system is not None:
            raise NervaError(f"{engine.model.name} has no chat template, so --system has nowhere to go")
        output.note(f"{engine.model.name} has no chat template: prompts go to it as they are (--raw)")
        raw = True
    book = None
    if ledger or ledger_file:
        from nerva_cli.runtime.ledger import Ledger

        book = Ledger(engine, tokenizer, ledger_file)
    session = ChatSession(engine, tokenizer, opts, max_tokens=max_tokens, raw=raw, system=system,
                          stops=stop or [], ledger=book, note=output.note, fmt=fmt)
    try:
        _converse(session, prompt, verbose, engine.runtime_line(threads), book if ledger else None, ledger_every,
                  lambda: _warm_up_while_typing(engine, tokenizer, threads, not raw))
    finally:
        if book:
            book.close()
        engine.close()


def _converse(session, prompt: str | None, verbose: bool, runtime: str, book=None, ledger_every: int = 1,
              warm_up=lambda: None) -> None:
    """One prompt's answer, or the chat, on a ChatSession (this process's engine) or a RemoteChat
    (a running server's)."""
    from nerva_cli.cli.repl import after_answer, chat_loop

    if prompt is not None:
        stats = session.answer(prompt, write=_write_stdout)
        _write_stdout("\n")
        after_answer(session, stats, verbose, _stats_line, book, ledger_every)
        if stats.stop_reason == "interrupted":  # Ctrl-C: a script must not take half an answer for one
            raise typer.Exit(130)
        if stats.cut_short:  # nor a cut JSON for JSON: the note said why
            raise typer.Exit(1)
        return
    chat_loop(session, _write_stdout, runtime, verbose, _stats_line, book, ledger_every, ready=warm_up())


def _through_server(model: str, raw: bool, system: str | None):
    """(client, the server's /api/show of `model`) where a nerva server answers at NERVA_HOST
    and its store has `model`; else None: this process runs it (pulling it first if need be).
    A path or a source to pull is never sent: the server runs only its store's models."""
    from nerva_cli.serve.client import ServerClient, ServerError

    if "/" in model or model.endswith(".gguf") or Path(model).expanduser().exists():  # a path, a Hub repo
        return None
    client = ServerClient.find()
    if client is None:
        return None
    try:
        return client, client.post("/api/show", {"model": model})
    except ServerError as e:
        if e.status == 404:  # not in its store: `run` pulls an alias here, as without a server
            return None
        raise


def _read_stdin() -> str:
    """All of stdin; bytes that are not UTF-8 become U+FFFD, whatever the locale (a strict one
    raised UnicodeDecodeError)."""
    raw = getattr(sys.stdin, "buffer", None)
    return raw.read().decode("utf-8", "replace") if raw is not None else sys.stdin.read()


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _stats_line(stats) -> str:
    return (f"prompt {stats.prompt_tokens} tok, {stats.prefill_tok_s:.1f} tok/s | "
            f"answer {stats.gen_tokens} tok, {stats.decode_tok_s:.1f} tok/s | "
            f"ttft {stats.ttft_s * 1000:.0f} ms | stop: {stats.stop_reason}")


def _warm_up_while_typing(engine, tokenizer, threads: int, template: bool):
    """What the chat's first answer would load on the way, loaded while the chat waits for its
    first message (EngineBase.load_kernels_aside), the chat template's jinja2 too. -> None, or
    ready(quiet=False), which the chat calls before acting on a message and on leaving."""

    def render() -> None:
        if template:
            try:
                tokenizer.render_chat([{"role": "user", "content": "Hi"}])
            except NervaError:  # a template refusing this message may take the user's: theirs will tell
                pass

    return engine.load_kernels_aside(threads, also=render)
