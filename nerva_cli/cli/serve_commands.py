"""`nerva serve`: ollama's and OpenAI's HTTP APIs over the store's models (nerva_cli/serve/); `nerva ps`
and `nerva stop`, which ask a running one what it holds and to unload a model."""

from __future__ import annotations

import os
from typing import Annotated, Optional

import typer

from nerva_cli.cli.app import app
from nerva_cli.cli.options import Backend, Ctx, Json, KvCache, Precision, RamBudget, Threads, VramBudget
from nerva_cli.errors import NervaError
from nerva_cli.hardware.machine import configure_threads


@app.command(epilog="Examples: nerva serve | nerva serve smollm2-135m --parallel 2 | "
                    "NERVA_HOST=0.0.0.0:8080 NERVA_API_KEY=secret nerva serve | "
                    "curl localhost:11435/api/generate -d '{\"model\": \"smollm2-135m\", \"prompt\": \"Hi\"}'")
def serve(
    models: Annotated[Optional[list[str]], typer.Argument(metavar="[MODEL]...", show_default=False, help="Models of the store to load at start (/health answers 503 until they are loaded); any other loads on its first request.")] = None,
    host: Annotated[Optional[str], typer.Option("--host", help="Address to listen on (default: NERVA_HOST's, else 127.0.0.1). Anything but loopback wants --api-key.")] = None,
    port: Annotated[Optional[int], typer.Option("--port", help="Port (default: NERVA_HOST's, else 11435, beside ollama's 11434; 0: any free one).")] = None,
    parallel: Annotated[int, typer.Option("--parallel", help="Requests per model that run at once, each with its own KV cache; on the CPU their tokens are computed together in one pass over the weights (on a GPU, one engine each).")] = 1,
    max_queue: Annotated[int, typer.Option("--max-queue", help="Requests that may wait for a slot, over all models; past them a request gets 503 with Retry-After.")] = 512,
    api_key: Annotated[Optional[str], typer.Option("--api-key", help="Key every request but /health must carry (Authorization: Bearer KEY or X-Api-Key: KEY); default NERVA_API_KEY's.")] = None,
    keep_alive: Annotated[str, typer.Option("--keep-alive", help="How long an idle model stays loaded, as ollama writes it (5m, 1h, 30s; 0: unload at once; -1: never). A request's keep_alive overrides it.")] = "5m",
    prompt_cache: Annotated[str, typer.Option("--prompt-cache", help="RAM for the KV of prompts whose slot has moved on (a chat's earlier turns, a system prompt many requests share), kept per model in whole prefill chunks (256 tokens on the CPU, 512 on a GPU) and copied back instead of read again; within what the RAM budget leaves beside the loaded models. 0: none.")] = "1G",
    cors: Annotated[Optional[list[str]], typer.Option("--cors", help="A web origin (https://chat.example.com) allowed besides localhost's (repeatable).")] = None,
    ctx: Ctx = None,
    threads: Threads = None,
    precision: Precision = None,
    ram_budget: RamBudget = None,
    vram_budget: VramBudget = None,
    kv_cache: KvCache = "f16",
    backend: Backend = "auto",
):
    """Serve the store's models over ollama's API (/api) and OpenAI's (/v1)."""
    threads = configure_threads(threads)
    from nerva_cli.cli import output
    from nerva_cli.runtime.options import EngineOptions
    from nerva_cli.serve.options import DEFAULT_HOST, DEFAULT_PORT, ServeOptions, is_loopback, parse_duration, parse_host

    env_host, env_port = parse_host(os.environ["NERVA_HOST"]) if os.environ.get("NERVA_HOST") else (None, None)
    engine = EngineOptions(backend=backend, precision=precision, ctx=ctx, threads=threads, ram_budget=ram_budget,
                           vram_budget=vram_budget, kv_cache=kv_cache)
    options = ServeOptions(host=host or env_host or DEFAULT_HOST,
                           port=next(p for p in (port, env_port, DEFAULT_PORT) if p is not None),
                           parallel=parallel, max_queue=max_queue, api_key=api_key or os.environ.get("NERVA_API_KEY"),
                           keep_alive=parse_duration(keep_alive, "--keep-alive"), cors=cors or [],
                           preload=models or [], engine=engine, prompt_cache=_size(prompt_cache, "prompt-cache"))
    from nerva_cli.serve.app import serve as run_server

    def say(where: str) -> None:
        output.info(f"nerva serve: {where}")
        if options.api_key is not None:
            output.info("an API key protects it (all but /health): Authorization: Bearer KEY or X-Api-Key: KEY")
        else:
            output.info("no API key: whoever reaches the address may use it (--api-key or NERVA_API_KEY sets one)")
            if not is_loopback(options.host):
                output.note(f"listening on {options.host}, not loopback, without an API key: anyone on the network "
                            "can run the models; set --api-key or NERVA_API_KEY")

    code = run_server(options, say=say)
    if code:
        raise typer.Exit(code)


def _size(text: str, flag: str) -> int:
    """A byte size as the budgets are written (512M, 2G, 0), without their `auto`."""
    from nerva_cli.errors import UsageError
    from nerva_cli.residency.planner import parse_budget

    wrong = UsageError(f"--{flag} {text!r}: expected a size like 512M or 2G, or 0 for none")
    if text.strip().lower() == "auto":
        raise wrong
    try:
        return parse_budget(text, flag)
    except UsageError:
        raise wrong from None


@app.command(epilog="Example: nerva ps | NERVA_HOST=127.0.0.1:8080 nerva ps --json")
def ps(json_: Json = False):
    """List the models a running `nerva serve` holds (as `ollama ps`): their memory, context and
    how long they stay loaded."""
    import time
    from datetime import datetime

    from nerva_cli.cli import output

    client = _server()
    held = client.get("/api/ps")["models"]
    if json_:
        output.print_json(held)
        return
    if not held:
        output.info(f"no models loaded by the server at {client.url}")
        return
    now = time.time()

    def until(stamp: str) -> str:
        left = datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() - now
        if left > 10 * 365 * 86400:
            return "forever"
        return "now" if left < 1 else f"{_duration(left)} from now"

    output.columns(("NAME", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"),
                   [(m["name"], output.human_bytes(m["size"]), "100% GPU" if m.get("size_vram") else "100% CPU",
                     str(m["context_length"]), until(m["expires_at"])) for m in held])


@app.command(epilog="Example: nerva stop smollm2-135m")
def stop(model: Annotated[str, typer.Argument(help="A model the server holds, name[:variant] as `nerva ps` lists it.")]):
    """Unload a model from a running `nerva serve` (its requests in flight finish first)."""
    from nerva_cli.cli import output
    from nerva_cli.serve.client import ServerError

    client = _server()
    held = {m["name"] for m in client.get("/api/ps")["models"]}
    try:
        key = client.post("/api/generate", {"model": model, "keep_alive": 0})["model"]
    except ServerError as e:
        if e.status == 404:
            raise NervaError(f"{model} is not a model of the server's store (`nerva ps` lists those it holds)") from None
        raise
    output.info(f"{key}: unloaded once its requests end" if key in held else f"{key} was not loaded")


def _server():
    from nerva_cli.serve.client import ServerClient, address

    client = ServerClient.find()
    if client is None:
        raise NervaError(f"no nerva server answers at {address()}: start one with `nerva serve` "
                         "(NERVA_HOST names another address)")
    return client


def _duration(seconds: float) -> str:
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size:
            n = round(seconds / size)
            return f"{n} {unit}{'s' * (n != 1)}"
    n = round(seconds)
    return f"{n} second{'s' * (n != 1)}"
