"""Qwen3.5 files through the command line: the commands run on them, and malformed ones end in one
line on stderr with a non-zero exit (no traceback, no ggml abort).

The checks themselves live in the graph families' specs (graphs branch); these tests pin what a
user sees for each problem the issue names: no `ssm_beta`, `rope.dimension_sections` of the wrong
length or sum, an unknown pre-tokenizer, an MTP block with missing tensors.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from deltarun.cli.main import cli
from test_loader_errors import GV, rewrite


def run(*args) -> object:
    return CliRunner().invoke(cli, [str(a) for a in args])


def one_line_error(result) -> str:
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("preset", ["tiny-qwen35", "tiny-qwen35moe"])
def test_generate_and_inspect_run_on_qwen35_files(tiny_model_path, preset):
    path = tiny_model_path(preset, "q8_0")
    r = run("generate", path, "-p", "Hello", "-n", "4", "--temp", "0")
    assert r.exit_code == 0, r.output
    r = run("inspect", path)
    assert r.exit_code == 0, r.output
    assert preset.removeprefix("tiny-") in r.output


@pytest.mark.parametrize("change, fragment", [
    ({"tensors": {"blk.0.ssm_beta.weight": None}}, "ssm_beta"),
    ({"set_kv": {"qwen35.rope.dimension_sections": ([3, 3, 2], GV.ARRAY, GV.INT32)}}, "dimension_sections"),
    ({"set_kv": {"qwen35.rope.dimension_sections": ([4, 3, 2, 0], GV.ARRAY, GV.INT32)}}, "dimension_sections"),
    ({"drop_keys": ("qwen35.rope.dimension_sections",)}, "dimension_sections"),
    ({"set_kv": {"tokenizer.ggml.pre": ("qwen99", GV.STRING)}}, "qwen99"),
    ({"tensors": {"blk.4.nextn.eh_proj.weight": None}}, "eh_proj"),
    ({"tensors": {"blk.4.attn_q.weight": None}}, "blk.4.attn_q"),
])
def test_malformed_qwen35_files_end_in_one_line(tiny_model_path, tmp_path, change, fragment):
    bad = tmp_path / "bad.gguf"
    rewrite(tiny_model_path("tiny-qwen35", "f32"), bad, **change)
    for args in (["generate", bad, "-p", "hi", "-n", "1"], ["generate", bad, "-p", "hi", "-n", "1", "--draft", "mtp"]):
        if "nextn" not in fragment and "blk.4" not in fragment and "--draft" in args:
            continue
        line = one_line_error(run(*args))
        assert fragment in line, line


def test_a_real_process_refuses_a_file_without_ssm_beta(tiny_model_path, tmp_path):
    bad = tmp_path / "no-beta.gguf"
    rewrite(tiny_model_path("tiny-qwen35moe", "f32"), bad, tensors={"blk.1.ssm_beta.weight": None})
    p = subprocess.run([sys.executable, "-m", "deltarun", "generate", str(bad), "-p", "hi", "-n", "1"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "Traceback" not in p.stderr and p.stdout == ""
    assert "ssm_beta" in p.stderr and len(p.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("preset", ["tiny-qwen35", "tiny-qwen35moe"])
@pytest.mark.parametrize("draft", ["mtp", "ngram"])
def test_speculative_decoding_keeps_the_greedy_output(tiny_model_path, preset, draft):
    path = tiny_model_path(preset, "f32")
    args = ["generate", path, "-p", "one two three one two", "-n", "16", "--temp", "0", "--threads", "1",
            "--kv-type", "f32"]
    plain = run(*args)
    spec = run(*args, "--draft", draft, "--draft-max", "3", "--vs-plain")
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout
    assert "same tokens" in spec.stderr


def test_perplexity_graph_and_bench_run_on_qwen35(tiny_model_path, tmp_path):
    path = tiny_model_path("tiny-qwen35moe", "q8_0")
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    for args in (["perplexity", path, "-f", text, "-c", "64", "--chunks", "1"],
                 ["graph", path, "--tokens", "4"],
                 ["bench", path, "-p", "8", "-n", "2", "-r", "1"]):
        r = run(*args)
        assert r.exit_code == 0, (args[0], r.output)
