"""The request guard: what every request passes before any endpoint sees it, whichever API it belongs to.

- **Host** (DNS rebinding): a web page can point a name it controls at 127.0.0.1 and then talk to
  the server as its own origin; the `Host` header still carries that name. Allowed: IP literals
  (an address cannot be rebound), `localhost` and `*.localhost` (RFC 6761: never resolved by DNS),
  this machine's host name, the name the server was bound to, and `--allowed-hosts` (`name`,
  `.suffix` for a domain and its subdomains, `*` for any).
- **Origin** (cross-site requests): a browser sends `Origin` with every cross-origin request and
  with same-origin POSTs. Allowed: none (non-browser clients), the server's own origin (`Origin`
  naming the `Host` the request was sent to: the chat page), and `--allowed-origins`, which also
  turns on CORS for exactly those origins (off by default).
- **Content-Type**: a request with a body must declare JSON (`application/json` or `*/*+json`):
  `text/plain`, form and multipart bodies are what a page may send cross-site without a preflight.
- **Errors**: an exception no handler answered is logged once with its traceback and answered 500
  in the API's error shape (never a traceback in the answer); a client that went away mid-body is
  one log line (INFO), not a traceback.
- **Headers**: `nosniff` and no framing on every answer, and a restrictive CSP on HTML that did not
  bring its own (`page_headers` writes the pages' own, with the hashes of their inline scripts).
  An answer given before the request's body was read to its end (a refusal from the declared
  length or the headers) says `Connection: close`: the client may finish sending that body after it
  has the answer, and the server, which cannot tell when, may close the connection meanwhile (the
  body deadline); a client that kept it for its next request would see that request dropped.

Errors have the shape of the API the path belongs to (`protocol.error_body`).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import ipaddress
import logging
import re
import socket
from typing import Any, Iterable

from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse

from deltarun.apps.serve.protocol import ApiError, error_body

log = logging.getLogger("uvicorn.error")      # configured by uvicorn: follows --log-level
SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}
DEFAULT_PORTS = {"http": "80", "https": "443"}
#: Every answer: no MIME sniffing, no framing by other sites, no referrer to the sites a page links.
COMMON_HEADERS = [(b"x-content-type-options", b"nosniff"), (b"x-frame-options", b"DENY"),
                  (b"referrer-policy", b"no-referrer")]
#: HTML that did not bring its own policy may load and run nothing.
DEFAULT_CSP = b"default-src 'none'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
_SCRIPT = re.compile(r"<script((?:\s[^>]*)?)>(.*?)</script\s*>", re.S | re.I)
NONE = "'none'"


def error_response(e: ApiError, path: str) -> JSONResponse:
    """`e` as JSON in the shape of the API `path` belongs to, with its status and headers."""
    return JSONResponse(error_body(e, path), status_code=e.status, headers=e.headers)


@functools.lru_cache(maxsize=16)       # the same page object each time: hashed once, then found by identity
def page_headers(html: str) -> dict[str, str]:
    """Headers of one of the server's own HTML pages: a CSP that lets only its own inline scripts
    run (by their SHA-256), its fetches go to this server only, and nobody frame it. Styles may be
    inline (the pages set style attributes, which a hash cannot allow)."""
    hashes = []
    for attrs, body in _SCRIPT.findall(html):
        if "src=" in attrs or "application/json" in attrs:
            continue                     # a data block (not run) or an external script (not ours)
        hashes.append("'sha256-" + base64.b64encode(hashlib.sha256(body.encode("utf-8")).digest()).decode() + "'")
    return {"Content-Security-Policy": (
        f"default-src 'none'; script-src {' '.join(hashes) or NONE}; style-src 'self' 'unsafe-inline'; "
        f"img-src 'self' data: blob:; connect-src 'self'; font-src 'self' data:; frame-ancestors 'none'; "
        f"base-uri 'none'; form-action 'none'")}


def _split_host(value: str) -> tuple[str, str]:
    """(host, port) of a Host header or an origin's authority; the host lowercased, no brackets."""
    value = value.strip().lower()
    if value.startswith("["):            # [::1]:8080
        host, _, rest = value[1:].partition("]")
        return host, rest[1:] if rest.startswith(":") else ""
    if value.count(":") == 1:
        host, _, port = value.partition(":")
        return host, port
    return value, ""


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


class HostPolicy:
    """Which `Host` and `Origin` values are allowed (see the module docstring)."""

    def __init__(self, bind_host: str = "127.0.0.1", allowed_hosts: Iterable[str] = (),
                 allowed_origins: Iterable[str] = ()):
        names = {h.strip().lower().rstrip(".") for h in allowed_hosts if h.strip()}
        self.any_host = "*" in names
        self.suffixes = tuple(n for n in names if n.startswith("."))
        self.names = {n for n in names if not n.startswith(".")} | {"localhost"}
        bind = bind_host.strip().lower()
        if bind and not _is_ip(bind.strip("[]")):
            self.names.add(bind)
        try:
            self.names.add(socket.gethostname().lower())
        except OSError:                  # pragma: no cover - no host name: nothing to add
            pass
        origins = {o.strip().lower().rstrip("/") for o in allowed_origins if o.strip()}
        self.any_origin = "*" in origins
        self.origins = origins - {"*"}

    @property
    def cors(self) -> bool:
        """Cross-origin requests were asked for (`--allowed-origins`)."""
        return self.any_origin or bool(self.origins)

    def host_allowed(self, header: str | None) -> bool:
        if header is None or self.any_host:
            return True                  # no Host: not a browser (HTTP/1.0)
        host, _ = _split_host(header)
        host = host.rstrip(".")
        return (_is_ip(host) or host in self.names or host.endswith(".localhost")
                or any(host == s[1:] or host.endswith(s) for s in self.suffixes))

    def origin_allowed(self, origin: str | None, host_header: str | None) -> bool:
        if origin is None:
            return True                  # not sent by a browser, or a same-origin GET
        origin = origin.strip().lower().rstrip("/")
        if self.any_origin or origin in self.origins:
            return True
        scheme, sep, authority = origin.partition("://")
        if not sep or host_header is None:
            return False                 # "null" (a sandboxed or file: page) and the like
        o_host, o_port = _split_host(authority)
        h_host, h_port = _split_host(host_header)
        default = DEFAULT_PORTS.get(scheme, "")
        return o_host == h_host and (o_port or default) == (h_port or default)


class RequestGuard:
    """ASGI middleware: the checks of the module docstring, before the app (outermost but for the
    server's own error middleware)."""

    def __init__(self, app: Any, policy: HostPolicy):
        self.app, self.policy = app, policy

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        started = False
        request_headers = {k.lower(): v for k, v in scope.get("headers") or []}
        body_owed = _has_body(request_headers)

        async def receive_watched() -> dict:
            nonlocal body_owed
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_owed = False        # the body's end, or the client gone
            return message

        async def send_with_headers(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = list(message.get("headers") or [])
                names = {k.lower() for k, _ in headers}
                headers += [(k, v) for k, v in COMMON_HEADERS if k not in names]
                ctype = next((v for k, v in headers if k.lower() == b"content-type"), b"")
                if ctype.startswith(b"text/html") and b"content-security-policy" not in names:
                    headers.append((b"content-security-policy", DEFAULT_CSP))
                if body_owed and b"connection" not in names:
                    headers.append((b"connection", b"close"))
                message = {**message, "headers": headers}
            await send(message)

        refusal = self._refusal(scope, request_headers)
        if refusal is not None:
            await error_response(refusal, path)(scope, receive_watched, send_with_headers)
            return
        try:
            await self.app(scope, receive_watched, send_with_headers)
        except ClientDisconnect:
            log.info("%s %s: the connection closed before the request body ended", scope["method"], path)
        except Exception as e:  # noqa: BLE001 - the last stop: logged once, answered without a traceback
            log.error("%s %s: internal error", scope["method"], path, exc_info=e)
            if not started:
                err = ApiError(f"internal error ({type(e).__name__}); the server log has the details", status=500,
                               type="server_error")
                await error_response(err, path)(scope, receive_watched, send_with_headers)

    def _refusal(self, scope: dict, headers: dict[bytes, bytes]) -> ApiError | None:
        host = _header(headers, b"host")
        if not self.policy.host_allowed(host):
            return ApiError(f"the Host {host!r} is not one this server answers to; start it with "
                            f"--allowed-hosts {_split_host(host or '')[0]} to allow it", status=403,
                            type="permission_error", code="host_not_allowed")
        origin = _header(headers, b"origin")
        if not self.policy.origin_allowed(origin, host):
            return ApiError(f"cross-origin requests from {origin!r} are not allowed; start the server with "
                            f"--allowed-origins {origin} to allow them", status=403, type="permission_error",
                            code="origin_not_allowed")
        if scope["method"] not in SAFE_METHODS and _has_body(headers):
            ctype = _header(headers, b"content-type") or ""
            media = ctype.split(";", 1)[0].strip().lower()
            if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
                return ApiError(f"the request body must be JSON sent with 'Content-Type: application/json' "
                                f"(not {ctype[:80]!r})", status=415, code="unsupported_media_type")
        return None


def _header(headers: dict[bytes, bytes], name: bytes) -> str | None:
    value = headers.get(name)
    return None if value is None else value.decode("latin-1")


def _has_body(headers: dict[bytes, bytes]) -> bool:
    length = headers.get(b"content-length")
    return b"transfer-encoding" in headers or (length is not None and length.strip() not in (b"", b"0"))
