"""The chat page's attach button with `serve --mmproj` (issue 31), in headless Chromium: an attached
image goes with the next message as an image_url part (a data: URL), the answer is the API's own to
the same request, the next turn resumes past the image, and a text-only server shows no button."""

from __future__ import annotations

import re

from test_pages import driver, js_text, normal, post_json, send_message, set_setting  # noqa: F401
from test_serve_vision import _image_tokens, _url
from test_vision_drafts import files  # noqa: F401 - the tiny VL pair and a picture

from browser import console_errors, screenshot, wait_for
from deltarun.apps.serve.server import ServeHandle, ServeSettings
from deltarun.runner.model import Model


def _server(text, mmproj=None) -> ServeHandle:
    return ServeHandle(lambda: Model(text, n_ctx=512, n_seq_max=2, n_threads=1),
                       ServeSettings(parallel=2, mmproj=mmproj, prefill_ahead=False))


def _idle(driver, n_answers: int) -> None:
    wait_for(lambda: driver.find_element("tag name", "body").get_attribute("data-idle") == "1"
             and len(driver.find_elements("css selector", ".msg.assistant .stats")) == n_answers, 120, "the answer")


def test_the_page_attaches_an_image(driver, files) -> None:
    text, mmproj, picture = files
    with _server(text, mmproj) as h:
        status, direct = post_json(h.base_url + "/v1/chat/completions", {"temperature": 0, "max_tokens": 6, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url(picture.read_bytes())}},
                                         {"type": "text", "text": "Say:"}]}]})
        assert status == 200, direct
        want = direct["choices"][0]["message"]
        n_image = _image_tokens(mmproj, picture.read_bytes())

        driver.get(h.base_url + "/")
        driver.execute_script("localStorage.clear()")
        driver.refresh()
        wait_for(lambda: driver.find_element("id", "attach").is_displayed(), what="the attach button")
        set_setting(driver, "sampling", "temperature", "0")
        set_setting(driver, "sampling", "max_tokens", "6")
        driver.find_element("id", "image-file").send_keys(str(picture))
        wait_for(lambda: driver.find_elements("css selector", "#attached img"), what="the attached image")
        send_message(driver, "Say:")
        _idle(driver, 1)
        assert driver.find_elements("css selector", ".msg.user .images img") and not driver.find_elements(
            "css selector", "#attached img")
        assert normal(js_text(driver, ".msg.assistant .content")) == normal(want.get("content") or "")
        screenshot(driver, "chat-image")

        send_message(driver, "And then?")        # the next turn resumes past the image
        _idle(driver, 2)
        stats = driver.find_elements("css selector", ".msg.assistant .stats")[-1].text
        assert int(re.search(r"\b(\d+) cached\b", stats).group(1)) > n_image, stats
        assert console_errors(driver) == []


def test_no_attach_button_without_a_vision_tower(driver, files) -> None:
    with _server(files[0]) as h:
        driver.get(h.base_url + "/")
        wait_for(lambda: driver.find_element("tag name", "body").get_attribute("data-vision") == "0",
                 what="the page reading /props")
        assert not driver.find_element("id", "attach").is_displayed()
