"""The live console at `/`: one HTML page, its script and style, the vendored chart library (uPlot, MIT,
src/inferd/console/vendor/), and its data at `GET /console/data` (api/console_feed.py).

Everything ships in the package: no build step and no CDN. These routes are outside the request chain:
they need no tenant key but, when an admin token is set or tenants are configured, the admin token,
sent as `Authorization: Bearer TOKEN` (scripts) or once as `/?token=TOKEN` (a browser), which sets an
HttpOnly cookie holding an HMAC of the token (never the token) and redirects to `/`. With tenants and no
admin token the console is refused: tenants must never see each other's panels.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable
from importlib import resources
from urllib.parse import parse_qs

from inferd.api.asgi import HttpRequest, HttpResponse, Router
from inferd.api.console_feed import ConsoleFeed

COOKIE = "inferd_console"
ASSETS = {
    "console.js": b"text/javascript; charset=utf-8",
    "console.css": b"text/css; charset=utf-8",
    "vendor/uPlot.iife.min.js": b"text/javascript; charset=utf-8",
    "vendor/uPlot.min.css": b"text/css; charset=utf-8",
}
SECURITY_HEADERS = [
    (b"cache-control", b"no-store"),
    (b"x-content-type-options", b"nosniff"),
    (b"content-security-policy", b"default-src 'self'; img-src 'self' data:; frame-ancestors 'none'"),
]


def _asset(name: str) -> bytes:
    return resources.files("inferd").joinpath("console", name).read_bytes()


class ConsoleAccess:
    """Who may open the console: everyone (no token, no tenants), the admin token's holder, or nobody
    (tenants configured without an admin token)."""

    def __init__(self, token: str | None, tenants_configured: Callable[[], bool]) -> None:
        self.token = token
        self.tenants_configured = tenants_configured
        self.cookie_value = (
            hmac.new(token.encode(), b"inferd-console", hashlib.sha256).hexdigest() if token else ""
        )

    def check(self, request: HttpRequest) -> HttpResponse | None:
        """None when the caller may see the console, else the refusal to send."""
        if self.token is None:
            if not self.tenants_configured():
                return None
            return _refusal(
                403, "the console needs an admin token when tenants are configured: set INFERD_ADMIN_TOKEN"
            )
        if self._valid_bearer(request) or self._valid_cookie(request):
            return None
        return _refusal(
            401,
            "the console needs the admin token: open /?token=TOKEN once, or send Authorization: Bearer TOKEN",
        )

    def token_login(self, request: HttpRequest) -> HttpResponse | None:
        """`/?token=TOKEN` with the right token: set the cookie and send the browser to `/`."""
        query = parse_qs(request.scope.get("query_string", b"").decode("latin-1"))
        sent = query.get("token", [""])[0]
        if not sent or self.token is None:
            return None
        if not hmac.compare_digest(sent.encode(), self.token.encode()):
            return _refusal(401, "the admin token is not valid")
        cookie = f"{COOKIE}={self.cookie_value}; Path=/; HttpOnly; SameSite=Strict"
        return HttpResponse(b"", 303, None, [(b"location", b"/"), (b"set-cookie", cookie.encode())])

    def _valid_bearer(self, request: HttpRequest) -> bool:
        scheme, _, credential = (request.header(b"authorization") or "").strip().partition(" ")
        assert self.token is not None
        return scheme.lower() == "bearer" and hmac.compare_digest(
            credential.strip().encode(), self.token.encode()
        )

    def _valid_cookie(self, request: HttpRequest) -> bool:
        for part in (request.header(b"cookie") or "").split(";"):
            name, _, value = part.strip().partition("=")
            if name == COOKIE and hmac.compare_digest(value.encode(), self.cookie_value.encode()):
                return True
        return False


def _refusal(status: int, message: str) -> HttpResponse:
    body = json.dumps({"error": message}).encode()
    return HttpResponse(body, status, b"application/json", list(SECURITY_HEADERS))


def add_console_routes(router: Router, feed: ConsoleFeed, access: ConsoleAccess) -> None:
    """`/`, `/console/data` and the page's assets."""

    def guarded(
        handler: Callable[[HttpRequest], HttpResponse],
    ) -> Callable[[HttpRequest], Awaitable[HttpResponse]]:
        async def route(request: HttpRequest) -> HttpResponse:
            refused = access.check(request)
            return refused if refused is not None else handler(request)

        return route

    async def index(request: HttpRequest) -> HttpResponse:
        login = access.token_login(request)
        if login is not None:
            return login
        refused = access.check(request)
        if refused is not None:
            return refused
        return HttpResponse(_asset("index.html"), 200, b"text/html; charset=utf-8", list(SECURITY_HEADERS))

    def data(request: HttpRequest) -> HttpResponse:
        query = parse_qs(request.scope.get("query_string", b"").decode("latin-1"))
        try:
            since = float(query.get("since", ["0"])[0])
        except ValueError:
            return _refusal(400, "since must be a number of seconds since the epoch")
        body = json.dumps(feed.page(since), separators=(",", ":"), allow_nan=False).encode()
        return HttpResponse(body, 200, b"application/json", list(SECURITY_HEADERS))

    def asset(name: str, content_type: bytes) -> Callable[[HttpRequest], HttpResponse]:
        body = _asset(name)
        return lambda request: HttpResponse(body, 200, content_type, list(SECURITY_HEADERS))

    router.add("GET", "/", index)
    router.add("GET", "/console/data", guarded(data))
    for name, content_type in ASSETS.items():
        router.add("GET", f"/console/{name}", guarded(asset(name, content_type)))
