"""The server's pages: the chat page at `/` and the graph page of the loaded model at `/graph`.

`/` serves deltarun/apps/pages/chat.html as it is (a static page; it talks to /v1/chat/completions
itself). `/graph` draws the graph the runner computes for one ubatch shape of the loaded model:
`?tokens=N` (default 8) prompt tokens, or `?decode=1` for the one-token decode graph after
`?past=P` (default 32) tokens. The dump is made on the model thread between two steps
(`Worker.call`), since building and allocating a graph uses the model's scheduler; the pages of the
last few shapes asked for are kept.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from deltarun.apps.serve.guard import page_headers
from deltarun.apps.serve.protocol import ApiError
from deltarun.base.errors import DeltarunError

DEFAULT_TOKENS = 8
DEFAULT_DECODE_PAST = 32
PAGES_KEPT = 8      # graph pages kept, newest first (a 48-layer model's page is ~2 MB)


def _int_param(request: Request, name: str, default: int, lo: int) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(f"{name} must be an integer, not {raw!r}", param=name, code="invalid_value") from None
    if value < lo:
        raise ApiError(f"{name} must be at least {lo}", param=name, code="invalid_value")
    return value


def graph_page(model: Any, n_tokens: int, n_past: int, expose_model_path: bool = False) -> str:
    """The graph page of `model` for an n_tokens ubatch after n_past tokens (on the model thread);
    the model named by its file name unless `expose_model_path` (as /props does)."""
    from pathlib import Path

    from deltarun.apps.graph_dump import dump_graph, ubatch_shape
    from deltarun.apps.graph_page import render_graph_html

    shape = ubatch_shape(model, n_tokens, 1, n_past, False)
    dump = dump_graph(model, shape, n_past=n_past).to_dict()
    if not expose_model_path:
        dump["model"] = Path(dump["model"]).name
    return render_graph_html(dump)


def page_routes(state: Any) -> list[Route]:
    from deltarun.apps.graph_page import read_asset

    chat_html = read_asset("chat.html")
    pages: OrderedDict[tuple[int, int], str] = OrderedDict()

    async def chat(request: Request) -> Response:
        return HTMLResponse(chat_html, headers={"Cache-Control": "no-cache", **page_headers(chat_html)})

    async def graph(request: Request) -> Response:
        state.builder  # 503 while the model loads, 500 when it failed
        decode = request.query_params.get("decode", "0") not in ("0", "", "false")
        n_tokens = 1 if decode else _int_param(request, "tokens", DEFAULT_TOKENS, 1)
        n_past = _int_param(request, "past", DEFAULT_DECODE_PAST if decode else 0, 0)
        model = state.worker.model
        if n_tokens > model.n_ubatch:
            raise ApiError(f"tokens must be at most the ubatch size (--ubatch) {model.n_ubatch}", param="tokens",
                           code="invalid_value")
        key = (n_tokens, n_past)
        html = pages.get(key)
        if html is None:
            try:
                page = partial(graph_page, n_tokens=n_tokens, n_past=n_past,   # pickles: a supervised worker
                               expose_model_path=state.expose_model_path)
                html = await asyncio.wrap_future(state.worker.call(page))
            except DeltarunError as e:
                raise ApiError(str(e), code="invalid_value") from None
            pages[key] = html
            while len(pages) > PAGES_KEPT:
                pages.popitem(last=False)
        pages.move_to_end(key)
        return HTMLResponse(html, headers=page_headers(html))

    return [Route("/", chat), Route("/graph", graph)]
