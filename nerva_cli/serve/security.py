"""Who may call the server: the API key (everything but /health), and which web pages' origins.

CORS alone does not protect a server on localhost: a page on any site can still send it a
"simple" POST (text/plain, no preflight) that runs, only the reply is hidden from the page. So a
request that names a foreign Origin is refused outright (403), as ollama does; requests without
an Origin (curl, the SDKs, editors) are not browsers' and pass."""

from __future__ import annotations

import hashlib
import hmac
import re

from starlette.datastructures import Headers

from nerva_cli.serve.errors import ApiError, error_response

LOCAL_ORIGIN = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"
PUBLIC_PATHS = ("/health",)  # a load balancer's probe needs no key


def origin_pattern(extra: list[str]) -> str:
    return "|".join([LOCAL_ORIGIN, *(re.escape(o) for o in extra)])


def _digest(text: str) -> bytes:
    # compared as digests: equal lengths, so the comparison's time says nothing of the key's length
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


class Guard:
    """ASGI middleware: 403 for a foreign Origin, 401 without the right key."""

    def __init__(self, app, api_key: str | None, origins: str):
        self.app = app
        self.key = None if api_key is None else _digest(api_key)
        self.origins = re.compile(origins)

    def refusal(self, headers: Headers, path: str) -> ApiError | None:
        origin = headers.get("origin")
        if origin is not None and not self.origins.fullmatch(origin):
            return ApiError(403, f"origin {origin} is not allowed (`nerva serve --cors ORIGIN` allows one)")
        if self.key is None or path in PUBLIC_PATHS:
            return None
        auth = headers.get("authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get("x-api-key")
        if not given:
            return ApiError(401, "this server needs an API key: send it as `Authorization: Bearer KEY` or "
                                 "`X-Api-Key: KEY`", code="invalid_api_key")
        if not hmac.compare_digest(_digest(given), self.key):
            return ApiError(401, "the API key is wrong", code="invalid_api_key")
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            err = self.refusal(Headers(scope=scope), scope["path"])
            if err is not None:
                await error_response(scope["path"], err)(scope, receive, send)
                return
        await self.app(scope, receive, send)
