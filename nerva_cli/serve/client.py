"""The CLI's side of a running `nerva serve`: where it listens (NERVA_HOST, as `serve` reads
it), and the few calls `nerva ps`, `nerva stop` and `nerva run` make over ollama's API. The
standard library's HTTP client: nothing here needs a package the server does not."""

from __future__ import annotations

import json
import os
import socket
import urllib.error
import urllib.request
from typing import Iterator

from nerva_cli.errors import NervaError

PROBE_S = 0.5  # a server on loopback answers /health in a few ms; nobody listening refuses at once


def address() -> str:
    """The URL `nerva serve` listens on by default here: NERVA_HOST's, else 127.0.0.1:11435."""
    from nerva_cli.serve.options import DEFAULT_HOST, DEFAULT_PORT, parse_host

    host, port = parse_host(os.environ["NERVA_HOST"]) if os.environ.get("NERVA_HOST") else (DEFAULT_HOST, None)
    if host in ("0.0.0.0", "::"):  # listening everywhere: reached on loopback
        host = "127.0.0.1" if host == "0.0.0.0" else "::1"
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port or DEFAULT_PORT}"


class ServerClient:
    def __init__(self, url: str, api_key: str | None = None):
        self.url, self.api_key = url.rstrip("/"), api_key

    @classmethod
    def find(cls) -> "ServerClient | None":
        """The nerva server at address(), or None where none answers (a refused connection
        returns at once; a silent address after PROBE_S). Another program on that port, ollama
        say, has no /health: it is not taken for one."""
        client = cls(address(), os.environ.get("NERVA_API_KEY") or None)
        try:
            with urllib.request.urlopen(f"{client.url}/health", timeout=PROBE_S):
                return client
        except urllib.error.HTTPError as e:
            return client if e.code == 503 else None  # 503: up, its first models still loading
        except (OSError, ValueError):  # refused, unreachable, timed out, a bad NERVA_HOST
            return None

    def _open(self, method: str, path: str, body: dict | None = None, timeout: float | None = 30):
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            return urllib.request.urlopen(request, timeout=timeout)
        except urllib.error.HTTPError as e:
            raise ServerError(e.code, self._message(e), self.url) from None
        except (OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            raise NervaError(f"the nerva server at {self.url} did not answer: {reason}") from None

    @staticmethod
    def _message(e: urllib.error.HTTPError) -> str:
        try:
            error = json.loads(e.read()).get("error")
        except (ValueError, OSError, AttributeError):
            return f"HTTP {e.code}"
        return error.get("message", str(error)) if isinstance(error, dict) else str(error)

    def get(self, path: str) -> dict:
        with self._open("GET", path) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict, timeout: float | None = 30) -> dict:
        with self._open("POST", path, body, timeout) as r:
            return json.loads(r.read())

    def stream(self, path: str, body: dict) -> Iterator[dict]:
        """ollama's NDJSON stream, an object per line; an error line raises ServerError. Closing
        the iterator closes the connection, which cancels the request on the server."""
        response = self._open("POST", path, {**body, "stream": True}, timeout=None)
        try:
            for line in response:
                if not line.strip():
                    continue
                obj = json.loads(line)
                if "error" in obj:
                    raise ServerError(500, str(obj["error"]), self.url)
                yield obj
        except (OSError, socket.timeout) as e:
            raise NervaError(f"the nerva server at {self.url} went away mid-answer ({e})") from None
        finally:
            response.close()


class ServerError(NervaError):
    """The server answered with an error; `status` its HTTP status."""

    def __init__(self, status: int, message: str, url: str):
        self.status = status
        hint = " (set NERVA_API_KEY to the server's key)" if status == 401 else ""
        super().__init__(f"the nerva server at {url}: {message}{hint}")
