"""The Qwen3.5 chat template (models/data/qwen35-chat-template.jinja, llama.cpp's Qwen3.5-4B.jinja)
rendered by deltarun.base.chat_template. Expected texts are written out by hand from the
template's rules: ChatML turns, `<think>\\n` opened after the generation prompt unless
enable_thinking is false (then an empty think block), tools listed as JSON in a `# Tools` system
block, assistant tool calls in the XML form, tool results wrapped in `<tool_response>` inside a
user turn, thinking of answers before the last user query dropped, content as a list of text parts.
"""

from __future__ import annotations

import json

import gguf
import pytest

from deltarun.base.chat_template import ChatTemplate
from deltarun.base.errors import TokenizerError
from deltarun.model_files import qwen35 as q35

TOOLS_PREAMBLE = (
    "# Tools\n\nYou have access to the following functions:\n\n<tools>"
)
TOOLS_INSTRUCTIONS = (
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested "
    "within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function call, "
    "but NOT after\n- If there is no function call available, answer the question like normal with your current "
    "knowledge and do not tell the user about function calls\n</IMPORTANT>"
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}},
                                                            "required": ["city"]}}}


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    return ChatTemplate(q35.chat_template(), eos_token="<|endoftext|>", name="Qwen3.5 template")


def test_the_shipped_template_is_llama_cpps_and_the_generated_file_carries_it(tiny_model_path):
    source = q35.chat_template()
    assert source.startswith("{%- set image_count = namespace(value=0) %}")
    reader = gguf.GGUFReader(str(tiny_model_path("tiny-qwen35", "q8_0")))
    assert reader.fields["tokenizer.chat_template"].contents() == source


def test_thinking_on_by_default_and_off_on_request(template):
    msgs = [{"role": "user", "content": "Hi"}]
    assert template.render(msgs) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert template.render(msgs, enable_thinking=True) == template.render(msgs)
    assert template.render(msgs, enable_thinking=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert template.render(msgs, add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"


def test_system_message_and_text_parts(template):
    msgs = [{"role": "system", "content": [{"type": "text", "text": " Be brief. "}]},
            {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"text": "world"}]}]
    assert template.render(msgs, enable_thinking=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello world<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_earlier_thinking_is_dropped_and_the_latest_kept(template):
    msgs = [{"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "<think>\nr1\n</think>\n\nA1"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "A2", "reasoning_content": "r2"}]
    assert template.render(msgs, add_generation_prompt=False) == (
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n<think>\nr2\n</think>\n\nA2<|im_end|>\n")


def test_tools_and_xml_tool_calls(template):
    msgs = [{"role": "system", "content": "Sys."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function",
                             "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2,
                                                                               "units": ["C", "F"]}}}]},
            {"role": "tool", "content": "sunny"}]
    want = ("<|im_start|>system\n" + TOOLS_PREAMBLE + "\n" + json.dumps(WEATHER, ensure_ascii=False)
            + TOOLS_INSTRUCTIONS + "\n\nSys.<|im_end|>\n"
            "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n<parameter=units>\n[\"C\", \"F\"]\n</parameter>\n"
            "</function>\n</tool_call><|im_end|>\n"
            "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n<think>\n")
    assert template.render(msgs, tools=[WEATHER]) == want


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "image", "image": "cat.png"},
    {"type": "video", "video": "clip.mp4"},
    {"image": "cat.png"},
])
def test_image_and_video_parts_are_refused_in_one_line(template, part):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]
    with pytest.raises(TokenizerError) as info:
        template.render(msgs)
    message = str(info.value)
    assert "\n" not in message and "message 0 (user)" in message and "only text parts" in message
    assert ("image" in message) or ("video" in message)


def test_template_errors_stay_one_line(template):
    with pytest.raises(TokenizerError, match="No user query found"):
        template.render([{"role": "system", "content": "only a system message"}])


@pytest.mark.parametrize("think", [False, True])
def test_chat_on_a_qwen35_file_uses_its_template_and_keeps_in_step(tiny_model_path, think):
    """A two-turn chat on tiny-qwen35 (its own Qwen3.5 template, thinking switched by --think /
    --no-think) gives the answers of fresh sessions that render the same history, in-process and
    through the CLI."""
    import copy

    from click.testing import CliRunner

    from deltarun.apps.chat import ChatSession
    from deltarun.cli.main import cli
    from deltarun.runner.model import Model

    path = tiny_model_path("tiny-qwen35", "f32")
    with Model(path, n_ctx=256, n_threads=1, kv_type="f32") as m:
        session = ChatSession(m, n_predict=6, enable_thinking=think)
        assert session.template.source == q35.chat_template()
        opened = session.render([{"role": "user", "content": "x"}])
        assert opened.endswith("<think>\n" if think else "<think>\n\n</think>\n\n")
        a, b = session.ask("Hello"), session.ask("How are you?")
        m.reset()
        fresh = ChatSession(m, n_predict=6, enable_thinking=think)
        fresh.messages = copy.deepcopy(session.messages[:-2])
        assert fresh.ask("How are you?") == b
    flag = "--think" if think else "--no-think"
    r = CliRunner().invoke(cli, ["chat", str(path), "-n", "6", flag, "--ctx", "256", "--threads", "1",
                                 "--kv-type", "f32", "--temp", "0"], input="Hello\n\nHow are you?\n")
    assert r.exit_code == 0, r.output
    assert r.stdout == f"{a}\n{b}\n"
