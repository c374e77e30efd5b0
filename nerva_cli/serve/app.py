"""The server: the Starlette app (the two APIs' routes, /health, /metrics, the guard and CORS,
errors in each API's shape) run by uvicorn on a socket bound here, so that a taken port is one
line of error rather than uvicorn's exit."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import sys
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from nerva_cli.errors import NervaError
from nerva_cli.serve import ollama_routes, openai_routes
from nerva_cli.serve.errors import ApiError, on_api_error, on_bug, on_http_error
from nerva_cli.serve.metrics import Metrics
from nerva_cli.serve.options import ServeOptions
from nerva_cli.serve.scheduler import Registry
from nerva_cli.serve.security import Guard, origin_pattern

log = logging.getLogger("nerva.serve")


@dataclass
class State:
    """What the handlers share (app.state.nerva)."""

    options: ServeOptions
    registry: Registry
    metrics: Metrics
    preload: list = field(default_factory=list)  # (key, model) loaded at start
    server: object = None  # the uvicorn.Server, told to exit when a preload fails
    exit_code: int = 0


async def health(request: Request):
    """200 when ready; 503 while the models asked for at start load, or while a first one loads."""
    registry = request.app.state.nerva.registry
    loading = registry.loading()
    if loading and not registry.loaded():
        return JSONResponse({"status": "loading", "loading": loading}, status_code=503)
    return JSONResponse({"status": "ok", "loading": loading})


async def metrics(request: Request):
    m = request.app.state.nerva.metrics
    return Response(m.exposition(), media_type=m.content_type)


async def _watch_preloads(state: State) -> None:
    """A model asked for at start that fails to load stops the server (exit 1): a server that
    was meant to hold it should not go on without it."""
    for key, _ in state.preload:
        worker = state.registry.workers.get(key)
        if worker is None:
            continue
        await asyncio.to_thread(worker.loaded.wait)
        if worker.error is not None:
            log.error("%s could not be loaded at start: stopping", key)
            state.exit_code = 1
            state.server.should_exit = True
            return


def build_app(options: ServeOptions, preload=()) -> Starlette:
    registry = Registry(options.engine, options.parallel, options.max_queue, options.keep_alive, options.prompt_cache)
    registry.metrics = Metrics(registry.running, registry.waiting, registry.prompt_cache_bytes)
    state = State(options, registry, registry.metrics, list(preload))

    @asynccontextmanager
    async def lifespan(app):
        for key, model in state.preload:
            registry.load(key, model, options.keep_alive)
        watcher = asyncio.create_task(_watch_preloads(state))
        yield
        watcher.cancel()
        registry.close()

    origins = origin_pattern(options.cors)
    app = Starlette(
        routes=[Route("/health", health, methods=["GET", "HEAD"]), Route("/metrics", metrics, methods=["GET"]),
                *ollama_routes.ROUTES, *openai_routes.ROUTES],
        middleware=[Middleware(CORSMiddleware, allow_origin_regex=origins, allow_methods=["*"], allow_headers=["*"]),
                    Middleware(Guard, api_key=options.api_key, origins=origins)],
        exception_handlers={ApiError: on_api_error, HTTPException: on_http_error, Exception: on_bug},
        lifespan=lifespan)
    app.state.nerva = state
    return app


def bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise NervaError(f"cannot listen on {host}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart need not wait out TIME_WAIT
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise NervaError(f"{host}:{port} is in use (another server?); --port or NERVA_HOST picks another") from None
        raise NervaError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    # listening now: a client that reads "listening on" and connects at once waits in the
    # backlog until uvicorn accepts, rather than being refused while the app starts
    sock.listen(2048)
    return sock


def url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def serve(options: ServeOptions, say=print) -> int:
    """Runs the server until it is stopped (Ctrl-C, SIGTERM); -> the exit code."""
    import uvicorn

    from nerva_cli.serve.models import resolve

    preload = []
    for ref in options.preload:
        try:
            preload.append(resolve(ref))
        except ApiError as e:
            raise NervaError(e.message) from None
    sock = bind(options.host, options.port)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    app = build_app(options, preload)
    state = app.state.nerva
    # log_config None: uvicorn's loggers go through the one format set above
    config = uvicorn.Config(app, log_config=None, timeout_graceful_shutdown=5, server_header=False)
    state.server = server = uvicorn.Server(config)
    say(f"listening on {url(sock)}: ollama's API under /api, OpenAI's under /v1, /health, /metrics")
    server.run(sockets=[sock])
    return state.exit_code
