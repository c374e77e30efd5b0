"""ServeOptions: what `nerva serve` is asked, checked once; addresses and durations written as
ollama writes them (OLLAMA_HOST, keep_alive)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from nerva_cli.errors import UsageError
from nerva_cli.runtime.options import EngineOptions

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 11435  # ollama's is 11434: the two can listen side by side
MAX_BODY = 4 << 20  # bytes of a request body; a 4096-token prompt is some 20 KB of text
DEFAULT_PROMPT_CACHE = 1 << 30  # a model's prompt cache: SmolLM2's 256-token chunk is 5.9 MB, an 8B's 34 MB

_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_GO_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def parse_duration(value, what: str) -> float | None:
    """ollama's keep_alive: a number of seconds, or a Go duration ("5m", "1h30m", "250ms"); a
    negative one keeps the model loaded for ever. -> seconds, or None for ever."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise UsageError(f"{what} must be a duration such as 5m, 30s or -1, got {type(value).__name__}")
    if isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = float(body)  # "300", "-1": seconds, as ollama reads a bare number
        except ValueError:
            parts = _GO_PART.findall(body)
            if not body or "".join(a + u for a, u in parts) != body:
                raise UsageError(f"{what} {value!r}: not a duration (examples: 5m, 1h30m, 30s, 0, -1)") from None
            seconds = sum(float(a) * _GO_UNITS[u] for a, u in parts)
        value = sign * seconds
    if math.isnan(value):
        raise UsageError(f"{what} must be a duration such as 5m, 30s or -1, got NaN")
    return None if value < 0 or math.isinf(value) else float(value)


def parse_host(text: str) -> tuple[str, int | None]:
    """NERVA_HOST as OLLAMA_HOST is written: host, host:port, :port, [v6]:port, with or without
    http://. -> (host, port or None)."""
    rest = text.strip()
    for scheme in ("http://", "https://"):
        if rest.lower().startswith(scheme):
            rest = rest[len(scheme):]
    rest = rest.rstrip("/")
    host, port = rest, None
    if rest.startswith("["):  # [::1]:8080
        host, _, tail = rest[1:].partition("]")
        if tail:
            port = tail.removeprefix(":")
    elif rest.count(":") == 1:
        host, port = rest.split(":")
    host = host or DEFAULT_HOST
    if port is None or port == "":
        return host, None
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"NERVA_HOST {text!r}: the port must be a number from 1 to 65535")
    return host, int(port)


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve anywhere
        return False


@dataclass
class ServeOptions:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    parallel: int = 1  # requests of one model that run at once (a sequence slot each: scheduler.py)
    max_queue: int = 512  # requests that may wait for a slot, over all models (ollama's default)
    api_key: str | None = None
    keep_alive: float | None = 300.0  # seconds an idle model stays loaded; None: for ever
    cors: list[str] = field(default_factory=list)  # origins allowed besides localhost's
    preload: list[str] = field(default_factory=list)  # models loaded at start (/health says 503 until then)
    engine: EngineOptions = field(default_factory=EngineOptions)
    max_body: int = MAX_BODY
    prompt_cache: int = DEFAULT_PROMPT_CACHE  # bytes of whole prompt chunks' KV rows a model keeps (0: none)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise UsageError(f"--port must be from 0 to 65535, got {self.port}")
        if self.parallel < 1:
            raise UsageError(f"--parallel must be >= 1, got {self.parallel}")
        if self.max_queue < 0:
            raise UsageError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.prompt_cache < 0:
            raise UsageError(f"--prompt-cache must be a size >= 0 (512M, 2G; 0: none), got {self.prompt_cache}")
        if self.api_key is not None and not self.api_key.strip():
            raise UsageError("--api-key is empty: give a key, or leave it out for none")
        for origin in self.cors:
            if not re.fullmatch(r"https?://[^/\s]+", origin):
                raise UsageError(f"--cors {origin!r}: give an origin as scheme://host[:port], "
                               "e.g. https://chat.example.com")
