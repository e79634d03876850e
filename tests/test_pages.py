"""The pages in a real browser (headless Chromium through selenium; see tests/browser.py).

The graph page of the tiny model must carry and draw every tensor of the JSON dump made with
the same options, find `rs_s_slot_rev` by name and show a clicked node's shape; the compare page
of an F32-vs-Q4_K comparison must mark the report's first failing node; no page may log a console
error. Screenshots are written to tests/screenshots/.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from deltarun.cli.main import cli

from browser import console_errors, screenshot, start_browser, wait_for

GRAPH_ARGS = ["--rs-slots", "2", "--tokens", "4"]


@pytest.fixture(scope="module")
def driver():
    d = start_browser()
    yield d
    d.quit()


def invoke(*args: object, exit_code: int = 0) -> str:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == exit_code, (result.output, result.exception)
    return result.stdout


@pytest.fixture(scope="module")
def graph_files(tiny_model_path, tmp_path_factory) -> tuple[dict, Path]:
    model = tiny_model_path("tiny", "f32")
    out = tmp_path_factory.mktemp("pages")
    dump = json.loads(invoke("graph", model, *GRAPH_ARGS, "--format", "json"))
    page = out / "graph.html"
    invoke("graph", model, *GRAPH_ARGS, "--format", "html", "-o", page)
    return dump, page


def open_page(driver, path: Path) -> None:
    driver.get(path.as_uri())
    wait_for(lambda: driver.execute_script("return !!(window.graphPage && window.graphPage.ready)"),
             what="the graph page's first paint")


def click_canvas_at(driver, tensor_id: str) -> None:
    from selenium.webdriver.common.action_chains import ActionChains

    pos = driver.execute_script("return window.graphPage.screenPos(arguments[0])", tensor_id)
    assert pos is not None, tensor_id
    assert 0 <= pos["x"] < pos["w"] and 0 <= pos["y"] < pos["h"], f"{tensor_id} is not in view: {pos}"
    canvas = driver.find_element("id", "canvas")
    # selenium 4 offsets are from the element's centre
    ActionChains(driver).move_to_element_with_offset(canvas, int(pos["x"] - pos["w"] / 2),
                                                     int(pos["y"] - pos["h"] / 2)).click().perform()


def test_graph_page_draws_every_tensor_of_the_dump(driver, graph_files):
    dump, page = graph_files
    ids = {t["id"] for t in dump["nodes"] + dump["leafs"]}
    assert len(dump["nodes"]) == dump["summary"]["n_nodes"] > 100
    open_page(driver, page)
    assert set(driver.execute_script("return window.graphPage.tensorIds()")) == ids
    driver.find_element("id", "expand-all").click()
    driver.find_element("id", "fit").click()
    drawn = wait_for(lambda: int(driver.find_element("id", "canvas").get_attribute("data-drawn-tensors") or 0)
                     == len(ids) and len(ids), what="every tensor drawn after 'fit'")
    assert drawn
    assert f"{len(ids)} tensors" in driver.find_element("id", "status").text
    screenshot(driver, "graph-fit")
    assert console_errors(driver) == []


def test_graph_page_search_and_click_show_shape(driver, graph_files):
    from selenium.webdriver.common.keys import Keys

    dump, page = graph_files
    by_name = {t["name"]: t for t in dump["nodes"] + dump["leafs"]}
    open_page(driver, page)
    search = driver.find_element("id", "search")
    search.send_keys("rs_s_slot_rev")
    items = wait_for(lambda: driver.find_elements("css selector", "#search-results li[data-id]"),
                     what="search results")
    assert [i.find_element("css selector", ".name").text for i in items] == ["rs_s_slot_rev"]
    search.send_keys(Keys.ENTER)
    wait_for(lambda: driver.find_element("id", "details-name").text == "rs_s_slot_rev", what="details")
    slot = by_name["rs_s_slot_rev"]
    shape = driver.find_element("css selector", "#details-table tr[data-field=ne] td:last-child").text
    assert shape == "[" + ", ".join(map(str, slot["ne"])) + "]"
    screenshot(driver, "graph-search")

    # a node found by search, then deselected and clicked on the canvas itself
    target = by_name["attn_norm-0"]
    driver.execute_script("window.graphPage.select(arguments[0])", target["id"])
    driver.find_element("id", "canvas").send_keys(Keys.ESCAPE)
    wait_for(lambda: not driver.find_elements("id", "details-name"), what="the selection cleared")
    click_canvas_at(driver, target["id"])
    wait_for(lambda: driver.find_elements("id", "details-name"), what="details after a click")
    assert driver.find_element("id", "details-name").text == "attn_norm-0"
    assert driver.find_element("id", "canvas").get_attribute("title").startswith(
        f"attn_norm-0\n{target['op']} {target['type']}")  # the hover tooltip
    fields = {r.get_attribute("data-field"): r.find_elements("css selector", "td")[1].text
              for r in driver.find_elements("css selector", "#details-table tr")}
    assert fields["ne"] == "[" + ", ".join(map(str, target["ne"])) + "]"
    assert fields["nb"] == "[" + ", ".join(map(str, target["nb"])) + "]"
    assert fields["op"] == target["op"] and fields["type"] == target["type"]
    assert fields["backend"] == target["backend"]
    inputs = [a.text for a in driver.find_elements("css selector", "#details-inputs a")]
    assert inputs == target["src"]
    screenshot(driver, "graph-click")
    assert console_errors(driver) == []


def test_graph_page_with_values(driver, tiny_model_path, tmp_path):
    model = tiny_model_path("tiny", "f32")
    page = tmp_path / "values.html"
    invoke("graph", model, "-p", "Hello world, a graph with values", "--format", "html", "-o", page)
    dump = json.loads(invoke("graph", model, "-p", "Hello world, a graph with values", "--format", "json"))
    open_page(driver, page)
    assert driver.find_element("id", "colour-mode").get_attribute("value") == "values"
    node = next(t for t in dump["nodes"] if t["name"] == "result_norm")
    driver.execute_script("window.graphPage.select(arguments[0])", node["id"])
    text = wait_for(lambda: driver.find_element("id", "details-values").text, what="values in the details")
    assert "rms" in text and "NaN / Inf 0 / 0" in text
    screenshot(driver, "graph-values")
    assert console_errors(driver) == []


def test_compare_page_marks_first_failing_node(driver, tiny_model_path, tmp_path):
    a, b = tiny_model_path("tiny", "f32"), tiny_model_path("tiny", "q4_k")
    page = tmp_path / "report.html"
    report = json.loads(invoke("compare", a, "--against", b, "-n", "2", "-q", "--json", "--html", page))
    assert not report["passed"]
    graph_index, first = next((i, g["first_failure"]) for i, g in enumerate(report["graphs"]) if g["first_failure"])
    open_page(driver, page)
    assert driver.find_element("id", "graph-select").get_attribute("value") == str(graph_index)
    assert driver.find_element("id", "verdict").text.startswith("FAIL")
    box = driver.find_element("id", "first-failure")
    assert box.find_element("css selector", "a").get_attribute("data-id") == first["id"]
    assert first["name"] in box.text
    # its inputs, each with its error (or exact for weights and inputs)
    lines = box.find_elements("css selector", "li")
    assert [li.find_element("css selector", "a").text for li in lines] == [i["name"] for i in first["inputs"]]
    # the first failure is selected and in view
    assert driver.find_element("id", "details-name").text == first["name"]
    pos = driver.execute_script("return window.graphPage.screenPos(arguments[0])", first["id"])
    assert 0 <= pos["x"] < pos["w"] and 0 <= pos["y"] < pos["h"]
    assert driver.find_element("css selector", "#details-table tr[data-field=status]").text.endswith(first["status"])
    logits = driver.find_element("id", "logits").text
    assert "exceeds" in logits and f"{sum(report['logits']['top1'])}/{len(report['logits']['top1'])}" in logits
    screenshot(driver, "compare")
    assert console_errors(driver) == []


def test_vision_tower_pages(driver, tmp_path):
    """`compare --mmproj A,B --html` (F32 against Q8_0 towers): the embeddings' verdict in place of
    the logits; `graph --mmproj --values --format html`: the image named in the summary."""
    from deltarun.model_files import qwen35_vision as qv

    text, mmproj = qv.write_vlm(tmp_path, "tiny-qwen35")
    q8 = qv.write_mmproj(tmp_path / "mmproj-q8_0.gguf", qv.vision_for(qv.qwen35.PRESETS["tiny-qwen35"]), "q8_0")
    page = tmp_path / "tower.html"
    report = json.loads(invoke("compare", text, "--mmproj", f"{mmproj},{q8}", "-q", "--json", "--html", page))
    open_page(driver, page)
    assert driver.find_element("id", "verdict").text == "PASS: every node and the embeddings are within their limits"
    emb = driver.find_element("id", "embeddings").text
    assert "embeddings NMSE" in emb and "6 x 256" in emb and driver.find_elements("id", "logits") == []
    assert "random pixels" in driver.find_element("id", "report").text and report["embeddings"]["status"] == "ok"
    assert console_errors(driver) == []
    graph = tmp_path / "tower-graph.html"
    invoke("graph", text, "--mmproj", mmproj, "--values", "--format", "html", "-o", graph)
    open_page(driver, graph)
    assert "image random 64 x 96 (seed 0)" in driver.find_element("tag name", "body").text
    assert console_errors(driver) == []


# ------------------------------------------------------------------------------------------------
# The pages of `deltarun serve`: the chat page at / and the loaded model's graph at /graph
# ------------------------------------------------------------------------------------------------
SERVE_CTX = 1024


@pytest.fixture(scope="module")
def server(tiny_model_path):
    from deltarun.apps.serve.server import ServeHandle, ServeSettings
    from deltarun.runner.model import Model

    path = tiny_model_path("tiny", "f32")
    with ServeHandle(lambda: Model(path, n_ctx=SERVE_CTX, n_seq_max=2, n_ubatch=64, rs_slots=2),
                     ServeSettings(parallel=2, chunk=32)) as h:
        yield h


def post_json(url: str, body: dict) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(url: str) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def set_setting(driver, section: str, field: str, value: str) -> None:
    from selenium.webdriver.common.keys import Keys

    summary = next(s for s in driver.find_elements("css selector", "details.settings summary") if s.text == section)
    if summary.find_element("xpath", "..").get_attribute("open") is None:
        summary.click()
    box = driver.find_element("id", field)
    box.clear()
    box.send_keys(value, Keys.TAB)  # "change" fires when the field loses focus


def send_message(driver, text: str) -> None:
    from selenium.webdriver.common.keys import Keys

    box = driver.find_element("id", "input")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def js_text(driver, selector: str) -> str:
    return driver.execute_script("const e = document.querySelector(arguments[0]); return e ? e.textContent : ''",
                                 selector)


def normal(s: str) -> str:
    return " ".join(s.split())


def test_chat_page_streams_an_answer(driver, server):
    message = "Hello there, tell me a story"
    # the server's own answer to the same request (greedy), to compare with what the page assembles
    status, direct = post_json(server.base_url + "/v1/chat/completions",
                               {"messages": [{"role": "user", "content": message}], "temperature": 0,
                                "max_tokens": 12})
    assert status == 200, direct
    want = direct["choices"][0]["message"]
    assert want["content"]

    driver.get(server.base_url + "/")
    driver.execute_script("localStorage.clear()")
    driver.refresh()
    wait_for(lambda: driver.find_element("id", "model-name").text, what="the model name from /v1/models")
    set_setting(driver, "sampling", "temperature", "0")
    set_setting(driver, "sampling", "max_tokens", "12")
    send_message(driver, message)
    wait_for(lambda: driver.find_element("tag name", "body").get_attribute("data-idle") == "1"
             and driver.find_elements("css selector", ".msg.assistant .stats"), 120, "the streamed answer")
    answer = driver.find_element("css selector", ".msg.assistant .content").text
    assert normal(answer) == normal(want["content"])
    if want.get("reasoning_content"):
        thinking = driver.find_element("css selector", ".msg.assistant details.thinking")
        assert thinking.get_attribute("open") is None  # folded
        assert normal(thinking.get_attribute("textContent")).endswith(normal(want["reasoning_content"]))
    stats = driver.find_element("css selector", ".msg.assistant .stats").text
    n_generated = direct["usage"]["completion_tokens"]
    assert stats.startswith(f"{n_generated} tokens") and "tokens/s" in stats
    assert re.search(r"\b(\d+) cached\b", stats), stats
    screenshot(driver, "chat")

    # the conversation is kept in the browser
    driver.refresh()
    wait_for(lambda: len(driver.find_elements("css selector", ".msg")) == 2, what="the conversation after a reload")
    assert normal(driver.find_element("css selector", ".msg.assistant .content").text) == normal(want["content"])
    assert console_errors(driver) == []


def test_chat_page_stop_button(driver, server):
    driver.get(server.base_url + "/")
    wait_for(lambda: driver.find_element("id", "model-name").text, what="the model name")
    set_setting(driver, "sampling", "max_tokens", str(SERVE_CTX // 2))
    set_setting(driver, "sampling", "temperature", "1")
    set_setting(driver, "sampling", "seed", "2")  # the same tokens on every run: 512 of them, no early end
    driver.find_element("id", "new-chat").click()
    send_message(driver, "Count to a thousand")
    # the answer is re-rendered on every chunk: read it in the page rather than through stale elements
    wait_for(lambda: js_text(driver, ".msg.assistant .content"), 120, "the first tokens")
    driver.find_element("id", "stop").click()
    stats = wait_for(lambda: js_text(driver, ".msg.assistant .stats"), 60, "the stopped answer")
    assert stats.endswith("stopped"), stats
    assert driver.find_element("id", "send").is_displayed() and not driver.find_element("id", "stop").is_displayed()
    assert console_errors(driver) == []


def test_served_graph_page(driver, server, tiny_model_path):
    status, body = get(server.base_url + "/graph?tokens=0")
    assert status == 400 and "tokens" in json.loads(body)["error"]["message"]
    status, body = get(server.base_url + "/graph?tokens=1000")
    assert status == 400 and "batch size" in json.loads(body)["error"]["message"]
    status, body = get(server.base_url + f"/graph?past={SERVE_CTX}")
    assert status == 400 and "context size" in json.loads(body)["error"]["message"]
    dump = json.loads(invoke("graph", tiny_model_path("tiny", "f32"), "--tokens", "8", "--rs-slots", "2",
                             "--ctx", str(SERVE_CTX), "--format", "json"))
    driver.get(server.base_url + "/")
    driver.find_element("id", "graph-link").click()  # opens /graph in a new tab
    wait_for(lambda: len(driver.window_handles) == 2, what="the graph tab")
    driver.close()
    driver.switch_to.window(driver.window_handles[0])
    assert driver.current_url == server.base_url + "/graph"
    wait_for(lambda: driver.execute_script("return !!(window.graphPage && window.graphPage.ready)"),
             what="the served graph page")
    names = driver.execute_script("return window.graphPage.tensorIds().map(i => window.graphPage.tensor(i).name)")
    assert sorted(names) == sorted(t["name"] for t in dump["nodes"] + dump["leafs"])
    screenshot(driver, "served-graph")
    driver.get(server.base_url + "/graph?decode=1&past=16")
    wait_for(lambda: driver.execute_script("return !!(window.graphPage && window.graphPage.ready)"),
             what="the served decode graph page")
    assert "1 x 1 tokens" in driver.title
    assert console_errors(driver) == []


def test_chat_page_folds_reasoning_and_sends_settings(driver, tmp_path):
    """The tiny model never thinks, so the `reasoning_content` path is checked against a replay of
    the stream llama-server / `deltarun serve` send for a thinking model (OpenAI chunks, the final
    chunk with usage and llama.cpp's timings), served with the page by a stdlib HTTP server; the
    request the page sends is recorded and checked too."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from deltarun.apps.graph_page import read_asset

    page = read_asset("chat.html").encode()
    received: list[dict] = []

    def chunk(delta: dict | None, finish: str | None = None, **extra) -> bytes:
        c = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "replay",
             "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
        return b"data: " + json.dumps(c).encode() + b"\r\n\r\n"

    stream = [chunk({"role": "assistant", "content": ""}), chunk({"reasoning_content": "Let me think"}),
              chunk({"reasoning_content": " about it."}), chunk({"content": "Hello"}), chunk({"content": " world"}),
              chunk({}, "stop"),
              chunk(None, usage={"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9,
                                 "prompt_tokens_details": {"cached_tokens": 3}},
                    timings={"cache_n": 3, "prompt_n": 2, "predicted_n": 4, "predicted_per_second": 42.0}),
              b"data: [DONE]\r\n\r\n"]

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _send(self, body: bytes, ctype: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/":
                self._send(page, "text/html; charset=utf-8")
            else:
                self._send(json.dumps({"object": "list", "data": [{"id": "replay"}]}).encode(), "application/json")

        def do_POST(self) -> None:
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for part in stream:
                self.wfile.write(part)
                self.wfile.flush()

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        driver.get(f"http://127.0.0.1:{httpd.server_address[1]}/")
        driver.execute_script("localStorage.clear()")
        driver.refresh()
        wait_for(lambda: driver.find_element("id", "model-name").text == "replay", what="the model name")
        driver.find_element("id", "system-prompt").send_keys("Be brief.")
        set_setting(driver, "sampling", "temperature", "0.3")
        set_setting(driver, "sampling", "seed", "7")
        send_message(driver, "Hi")
        wait_for(lambda: js_text(driver, ".msg.assistant .stats"), 30, "the replayed answer")
    finally:
        httpd.shutdown()
        thread.join(10)
    (body,) = received
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0.3 and body["seed"] == 7 and body["model"] == "replay"
    thinking = driver.find_element("css selector", ".msg.assistant details.thinking")
    assert thinking.get_attribute("open") is None
    assert js_text(driver, ".msg.assistant .thinking-text") == "Let me think about it."
    assert js_text(driver, ".msg.assistant .content") == "Hello world"
    stats = js_text(driver, ".msg.assistant .stats")
    assert stats.startswith("4 tokens \u00b7 42.0 tokens/s \u00b7 prompt 5 tokens \u00b7 3 cached"), stats
    thinking.find_element("css selector", "summary").click()
    assert thinking.find_element("css selector", ".thinking-text").is_displayed()
    screenshot(driver, "chat-thinking")
    assert console_errors(driver) == []


# ------------------------------------------------------------------------------------------------
# Without a browser: the layout's invariants, self-containment, option checks
# ------------------------------------------------------------------------------------------------
def test_layout_places_every_tensor_without_overlap(graph_files):
    from deltarun.apps import graph_page as gp

    dump, _ = graph_files
    view = gp.dump_view(dump)
    ts = view["tensors"]
    assert len(ts) == len(dump["nodes"]) + len(dump["leafs"])
    by_id = {t["id"]: t for t in ts}
    rows: dict[tuple[int, int], list[float]] = {}
    for t in ts:
        rows.setdefault((t["band"], t["rank"]), []).append(t["x"])
        assert 0 <= t["rank"] < view["bands"][t["band"]]["n_ranks"]
        assert 0 <= t["x"] <= view["bands"][t["band"]]["width"] - gp.NODE_W + 0.1
        for s in t["src_ids"]:  # an input in the same band is drawn above its consumer
            if s in by_id and by_id[s]["band"] == t["band"]:
                assert by_id[s]["rank"] < t["rank"], (s, t["id"])
    for xs in rows.values():
        xs.sort()
        assert all(b - a >= gp.NODE_W + gp.GAP_X - 0.2 for a, b in zip(xs, xs[1:]))
    labels = [b["label"] for b in view["bands"]]
    assert labels[0] == "graph inputs" and labels[-1] == "output head"
    assert [b["layer"] for b in view["bands"][1:-1]] == [0, 1, 2, 3]
    assert labels[1] == "layer 0: linear attention (delta-net)" and labels[4] == "layer 3: full attention"
    # bands hold their layer's nodes; splits count backend runs (one backend: one split)
    assert all(t["layer"] == view["bands"][t["band"]]["layer"] for t in ts if t["kind"] == "node" and t["layer"] is not None)
    assert {t["split"] for t in ts if t["kind"] == "node"} == {0}


def test_pages_are_self_contained(graph_files):
    from deltarun.apps.graph_page import read_asset

    _, page = graph_files
    for text in (page.read_text(), read_asset("chat.html")):
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//|@import|url\(\s*["']?https?:""", text)
        assert "<script src" not in text and "<link rel=\"stylesheet\"" not in text
    html = page.read_text()
    assert html.count("</script>") == 2  # the data cannot close its element early


def test_compare_html_needs_an_existing_folder(tiny_model_path, tmp_path):
    result = CliRunner().invoke(cli, ["compare", str(tiny_model_path("tiny", "f32")), "-s", "0", "-n", "4", "-q",
                                      "--html", str(tmp_path / "missing" / "report.html")])
    assert result.exit_code == 2 and "no such folder" in result.output


def test_served_graph_page_names_the_model_by_file_name(server, tiny_model_path):
    """As /props: the graph page does not show the model's absolute path (a local user's directory
    layout) unless the server was started with --expose-model-path."""
    path = tiny_model_path("tiny", "f32")
    status, body = get(server.base_url + "/graph?tokens=2")
    assert status == 200
    html = body.decode()
    assert str(path) not in html and str(path.parent) not in html and path.name in html
