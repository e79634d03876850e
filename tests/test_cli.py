"""The `generate`, `inspect` and `make-tiny` commands, run in-process with click's CliRunner
(and once through the real console entry point)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from click.testing import CliRunner

from deltarun.base.gguf_file import GGUFFile
from deltarun.cli.main import cli
from deltarun.graphs.qwen3next import Qwen3NextFamily
from deltarun.model_files import generate as gen
from deltarun.runner.generation import generate_tokens
from deltarun.runner.memory import memory_bytes
from deltarun.runner.model import Model
from deltarun.runner.sampling import GREEDY, Sampler, SamplingParams

PROMPT = "Hello world, this is a test"
FAST = ["--ctx", "256", "--threads", "1"]  # one thread: ggml spin-waits, so more threads than idle cores is slow


def run(*args: str | Path):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result


def ok(*args: str | Path):
    result = run(*args)
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def expected_text(path: Path, prompt: str, n: int, params: SamplingParams) -> str:
    with Model(path, n_ctx=256, n_threads=1) as m:
        toks = list(generate_tokens(m, m.tokenizer.encode(prompt), n, Sampler(params)))
        return m.tokenizer.decode(toks)


# --- generate -----------------------------------------------------------------------------------
def test_generate_greedy_is_deterministic_and_matches_the_api(tiny_model):
    a = ok("generate", tiny_model, "-p", PROMPT, "-n", "24", "--temp", "0", *FAST)
    b = ok("generate", tiny_model, "-p", PROMPT, "-n", "24", "--temp", "0", *FAST)
    assert a.stdout == b.stdout
    want = expected_text(tiny_model, PROMPT, 24, GREEDY)
    assert len(want) > 0
    assert a.stdout == want + "\n"
    assert "greedy" in a.stderr
    assert "prompt eval" in a.stderr and "tokens per second" in a.stderr


def test_generate_sampled_is_reproducible_with_a_seed(tiny_model):
    args = ["generate", tiny_model, "-p", PROMPT, "-n", "24", "--temp", "0.8", *FAST]
    a = ok(*args, "--seed", "1")
    b = ok(*args, "--seed", "1")
    c = ok(*args, "--seed", "2")
    assert a.stdout == b.stdout
    assert a.stdout != c.stdout
    want = expected_text(tiny_model, PROMPT, 24, SamplingParams(temperature=0.8, seed=1))
    assert a.stdout == want + "\n"
    assert "seed 1" in a.stderr


def test_generate_options_reach_the_model_and_sampler(tiny_model):
    """Every model option is accepted; greedy output does not depend on ubatch size or kernel."""
    base = ok("generate", tiny_model, "-p", PROMPT, "-n", "8", "--temp", "0", "--kv-type", "f32", *FAST)
    other = ok("generate", tiny_model, "-p", PROMPT, "-n", "8", "--temp", "0", "--kv-type", "f32",
               "--ubatch", "3", "--rs-slots", "2", "--delta-net", "primitive", "--backend", "cpu", *FAST)
    assert other.stdout == base.stdout
    assert "delta-net primitive" in other.stderr and "delta-net fused" in base.stderr   # the option arrived
    penalized = ok("generate", tiny_model, "-p", PROMPT, "-n", "8", "--seed", "3", "--top-k", "5",
                   "--top-p", "0.5", "--min-p", "0.1", "--repeat-penalty", "1.3", "--repeat-last-n", "-1", *FAST)
    assert "top-k 5" in penalized.stderr and "repeat-penalty 1.3" in penalized.stderr


def test_generate_reads_the_prompt_from_a_file(tiny_model, tmp_path):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(PROMPT, encoding="utf-8")
    a = ok("generate", tiny_model, "-f", prompt_file, "-n", "8", "--temp", "0", *FAST)
    b = ok("generate", tiny_model, "-p", PROMPT, "-n", "8", "--temp", "0", *FAST)
    assert a.stdout == b.stdout
    echoed = ok("generate", tiny_model, "-p", PROMPT, "-n", "8", "--temp", "0", "--echo", *FAST)
    assert echoed.stdout == PROMPT + b.stdout


def test_generate_n_zero_only_evaluates_the_prompt(tiny_model):
    r = ok("generate", tiny_model, "-p", PROMPT, "-n", "0", "--temp", "0", *FAST)
    assert r.stdout == "\n"
    assert "0 tokens" in r.stderr


def test_generate_stops_when_the_context_is_full(tiny_model):
    r = ok("generate", tiny_model, "-p", PROMPT, "-n", "100", "--temp", "0", "--ctx", "12", "--threads", "1")
    assert "context full" in r.stderr


def test_generate_without_a_model_uses_the_built_in_one():
    target = gen.default_model_path()
    first = ok("generate", "-p", PROMPT, "-n", "6", "--temp", "0", *FAST)
    assert "no model given: using the built-in model" in first.stderr and str(target) in first.stderr
    assert first.stdout == ok("generate", target, "-p", PROMPT, "-n", "6", "--temp", "0", *FAST).stdout


def test_a_missing_built_in_model_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(gen, "default_model_path", lambda: tmp_path / "gone.gguf")
    r = run("generate", "-p", PROMPT, "-n", "2", *FAST)
    assert r.exit_code != 0 and "built-in model" in r.output and "missing" in r.output


@pytest.mark.parametrize("args, fragment", [
    (["--temp", "-1"], "--temp"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"),
    (["--min-p", "-0.1"], "--min-p"),
    (["--min-p", "2"], "--min-p"),
    (["--threads", "0"], "--threads"),
    (["--ctx", "0"], "--ctx"),
    (["--ubatch", "0"], "--ubatch"),
    (["--rs-slots", "0"], "--rs-slots"),
    (["-n", "-2"], "--n-predict"),
    (["--top-k", "-2"], "--top-k"),
    (["--repeat-penalty", "0"], "--repeat-penalty"),
    (["--delta-net", "magic"], "--delta-net"),
    (["--kv-type", "q8_0"], "--kv-type"),
    (["--temp", "hot"], "--temp"),
    # nan passes every bound check (it compares false) and then broke sampling; inf means nothing
    (["--temp", "nan"], "--temp"),
    (["--top-p", "nan"], "--top-p"),
    (["--min-p", "nan"], "--min-p"),
    (["--repeat-penalty", "inf"], "--repeat-penalty"),
    (["--repeat-penalty", "1e-30"], "--repeat-penalty"),     # seen tokens' logits to inf: NaN probabilities
    # past what ggml takes: its thread limit, I32 positions, the slots kept per sequence
    (["--threads", "513"], "--threads"),
    (["--ctx", "2147483648"], "--ctx"),
    (["--rs-slots", "257"], "--rs-slots"),
])
def test_generate_rejects_bad_options(tiny_model, args, fragment):
    r = run("generate", tiny_model, "-p", "hi", *args)
    assert r.exit_code == 2
    assert fragment in r.stderr and "Invalid value" in r.stderr
    assert "Traceback" not in r.output
    assert r.stdout == ""


@pytest.mark.parametrize("args, fragment, code", [
    ([], "no prompt", 2),
    (["-p", ""], "empty", 2),
    (["-p", "hi", "-f", "x.txt"], "not both", 2),
    (["-f", "/nonexistent/prompt.txt"], "cannot read", 2),
    (["-p", "hi", "--backend", "quantum"], "unknown backend 'quantum'", 5),
    (["-p", "hi", "--ubatch", "1", "--rs-slots", "3"], "--ubatch 1 must be at least --rs-slots 3", 1),
    (["-p", PROMPT * 20, "--ctx", "16"], "context holds 16", 1),
])
def test_generate_usage_and_run_errors_are_one_clean_line(tiny_model, args, fragment, code):
    r = run("generate", tiny_model, *args)
    assert r.exit_code == code, r.output
    assert fragment in r.stderr
    assert "Traceback" not in r.output
    assert not isinstance(r.exception, Exception) or isinstance(r.exception, SystemExit)


def test_generate_on_a_file_that_is_not_gguf(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_text("this is not a model at all")
    r = run("generate", bad, "-p", "hi")
    assert r.exit_code == 2
    assert "not a GGUF file" in r.stderr and "Traceback" not in r.output
    missing = run("generate", tmp_path / "missing.gguf", "-p", "hi")
    assert missing.exit_code == 2 and "no such file" in missing.stderr


def test_console_entry_point_errors_without_traceback(tmp_path):
    """Through a real process: a bad value and a bad file each end in one line, no traceback."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x63\x00\x00\x00" + b"\x00" * 32)
    for args, code, text in [(["generate", str(bad), "-p", "hi", "--top-p", "2"], 2, "--top-p"),
                             (["inspect", str(bad)], 2, "unsupported GGUF version 99")]:
        p = subprocess.run([sys.executable, "-m", "deltarun", *args], capture_output=True, text=True, timeout=120)
        assert p.returncode == code, p.stderr
        assert text in p.stderr and "Traceback" not in p.stderr
        assert p.stdout == ""


def test_console_entry_point_generates(tiny_model):
    p = subprocess.run([sys.executable, "-m", "deltarun", "generate", str(tiny_model), "-p", PROMPT, "-n", "12",
                        "--temp", "0", *FAST], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout == expected_text(tiny_model, PROMPT, 12, GREEDY) + "\n"
    assert "generation:" in p.stderr


# --- inspect ------------------------------------------------------------------------------------
def test_inspect_shows_layers_tensors_and_memory(tiny_model):
    r = ok("inspect", tiny_model)
    out = r.stdout
    assert "runnable      yes" in out
    assert "LLLA" in out and "linear attention   0-2" in out and "full attention     3" in out
    for name in ("token_embd.weight", "blk.0.attn_qkv.weight", "blk.3.attn_q.weight", "blk.2.ssm_a"):
        assert name in out
    assert "Q8_0" in out and "F32" in out
    assert "[2330 items]" in out          # token list summarised, not printed
    assert "chars)" in out                # the chat template is cut short
    assert "KV cache" in out and "recurrent state" in out


def test_inspect_json_numbers(tiny_model):
    r = ok("inspect", tiny_model, "--json", "--ctx", "1000", "--rs-slots", "3")
    d = json.loads(r.stdout)
    f = GGUFFile(tiny_model)
    hp = Qwen3NextFamily.read_hparams(f)
    assert d["runnable"] is True and d["problems"] == []
    assert d["architecture"] == "qwen3next"
    assert d["layers"]["pattern"] == "LLLA"
    assert d["layers"]["linear_attention"] == [0, 1, 2] and d["layers"]["full_attention"] == [3]
    assert {t["name"] for t in d["tensors"]} == set(f.tensors)
    by_name = {t["name"]: t for t in d["tensors"]}
    assert by_name["blk.0.attn_qkv.weight"]["shape"] == [256, 2 * 4 * 32 + 8 * 32]
    assert by_name["blk.0.attn_qkv.weight"]["type"] == "Q8_0"
    assert d["parameters"]["total"] == sum(t.n_elements for t in f.tensors.values())
    mem = d["memory"]
    assert mem["weights"] == sum(t.nbytes for t in f.tensors.values())
    assert mem["kv_cache"] + mem["recurrent_state"] == memory_bytes(hp, 1000, 1, 3, "f16")
    assert mem["recurrent_state"] == memory_bytes(hp, 0, 1, 3)
    assert mem["kv_cache"] == 2 * 1 * 64 * 2 * 1000 * 2   # K and V, one attention layer, f16
    assert d["metadata"]["tokenizer.ggml.tokens"] == "[2330 items]"
    # the memory figure is what a Model really allocates
    with Model(tiny_model, n_ctx=1000, rs_slots=3, n_threads=1) as m:
        assert m.memory.nbytes >= mem["kv_cache"] + mem["recurrent_state"]
        assert m.memory.nbytes - (mem["kv_cache"] + mem["recurrent_state"]) < 4096


def test_inspect_mtp_and_legacy_layers(tiny_model_path):
    d = json.loads(ok("inspect", tiny_model_path("tiny-mtp"), "--json").stdout)
    assert d["layers"]["pattern"] == "LLLAM" and d["layers"]["mtp"] == [4]
    assert d["parameters"]["mtp"] > 0
    assert d["parameters"]["trunk"] + d["parameters"]["mtp"] == d["parameters"]["total"]
    text = ok("inspect", tiny_model_path("tiny-legacy")).stdout
    assert "blk.0.ssm_in.weight" in text and "LLLA" in text


def test_inspect_a_file_deltarun_cannot_run(tmp_path):
    path = tmp_path / "llama.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_tensor("token_embd.weight", np.zeros((10, 8), np.float32))
    for i in range(2):
        w.add_tensor(f"blk.{i}.attn_q.weight", np.zeros((8, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = ok("inspect", path)
    assert "runnable      no" in r.stdout and "no graph for architecture 'llama'" in r.stdout
    assert "blk.1.attn_q.weight" in r.stdout
    d = json.loads(ok("inspect", path, "--json").stdout)
    assert d["runnable"] is False
    assert d["layers"]["pattern"] == "AA" and d["layers"]["source"] == "tensor names"
    assert d["parameters"]["total"] == 80 + 2 * 64
    assert "kv_cache" not in d["memory"]


def test_inspect_a_qwen3next_file_missing_a_tensor(tmp_path, monkeypatch):
    full = gen.model_tensors

    def without_ssm_a(*a, **k):
        t = full(*a, **k)
        del t["blk.1.ssm_a"]
        return t

    monkeypatch.setattr(gen, "model_tensors", without_ssm_a)
    path = gen.write_model(tmp_path / "broken.gguf", "tiny", "f32")
    d = json.loads(ok("inspect", path, "--json").stdout)
    assert d["runnable"] is False
    assert any("blk.1.ssm_a" in p for p in d["problems"])
    assert d["layers"]["pattern"] == "LLLA" and d["layers"]["source"] == "metadata"
    assert "kv_cache" in d["memory"]   # hyper-parameters were readable


@pytest.mark.parametrize("content, fragment", [
    (b"", "too short"),
    (b"PK\x03\x04 a zip file, not a model", "not a GGUF file"),
    (b"GGUF\x03\x00\x00\x00\xff\xff", "damaged GGUF"),
])
def test_inspect_rejects_non_gguf_cleanly(tmp_path, content, fragment):
    path = tmp_path / "x.gguf"
    path.write_bytes(content)
    r = run("inspect", path)
    assert r.exit_code == 2
    assert fragment in r.stderr and r.stderr.startswith("error: ")
    assert "Traceback" not in r.output and r.stdout == ""
    assert run("inspect", tmp_path).exit_code == 2
    assert "is a directory" in run("inspect", tmp_path).stderr


# --- make-tiny ----------------------------------------------------------------------------------
@pytest.mark.parametrize("wtype", list(gen.WEIGHT_TYPES))
def test_make_tiny_writes_a_loadable_file_for_each_type(tmp_path, tiny_model_path, wtype):
    out = tmp_path / f"m-{wtype}.gguf"
    r = ok("make-tiny", out, "--type", wtype)
    assert str(out) in r.stdout
    f = GGUFFile(out)
    hp = Qwen3NextFamily(f).hp           # reads the hyper-parameters and validates the tensors
    assert f.tensors["blk.0.ssm_out.weight"].type_name == gen.WEIGHT_TYPES[wtype].name
    assert f.get("general.file_type") == gen._FILE_TYPES[wtype]
    with Model(out, n_ctx=64, n_threads=1) as m:
        logits = m.eval(m.tokenizer.encode(PROMPT))
        assert logits.shape == (hp.n_vocab,) and np.isfinite(logits).all()
    # same tensors as the generator's own output for that preset, type and seed
    ref = GGUFFile(tiny_model_path("tiny", wtype))
    assert [(t.name, t.ggml_type, t.ne) for t in f.tensors.values()] == \
           [(t.name, t.ggml_type, t.ne) for t in ref.tensors.values()]
    for name in ("token_embd.weight", "blk.3.attn_q.weight"):
        assert np.array_equal(f.tensor_bytes(f.tensors[name]), ref.tensor_bytes(ref.tensors[name]))


def test_make_tiny_presets_mtp_and_seed(tmp_path):
    a = tmp_path / "a.gguf"
    ok("make-tiny", a, "--preset", "tiny-eqheads", "--mtp", "--seed", "5")
    f = GGUFFile(a)
    hp = Qwen3NextFamily.read_hparams(f)
    assert hp.n_mtp == 1 and hp.ssm_n_v_heads == hp.ssm_n_k_heads == 8
    assert "blk.4.nextn.eh_proj.weight" in f.tensors
    b = tmp_path / "b.gguf"
    ok("make-tiny", b, "--preset", "tiny-eqheads", "--mtp", "--seed", "6")
    name = "blk.0.attn_qkv.weight"
    assert not np.array_equal(f.tensor_array(name), GGUFFile(b).tensor_array(name))
    tied = tmp_path / "t.gguf"
    ok("make-tiny", tied, "--preset", "tiny-tied")
    assert "output.weight" not in GGUFFile(tied).tensors


@pytest.mark.parametrize("args, fragment", [
    (["--type", "q3_k"], "--type"),
    (["--preset", "huge"], "--preset"),
    (["--seed", "-1"], "--seed"),
])
def test_make_tiny_rejects_bad_options(tmp_path, args, fragment):
    r = run("make-tiny", tmp_path / "x.gguf", *args)
    assert r.exit_code == 2 and fragment in r.stderr and "Traceback" not in r.output
    assert not (tmp_path / "x.gguf").exists()


def test_make_tiny_unwritable_destination_is_a_clean_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = run("make-tiny", blocker / "sub" / "m.gguf")
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert "error" in r.stderr.lower()


def test_help_lists_the_commands():
    r = ok("--help")
    for name in ("generate", "inspect", "make-tiny"):
        assert name in r.stdout
    for name in ("generate", "inspect", "make-tiny"):
        assert ok(name, "--help").stdout.startswith("Usage:")


# --- errors a user meets, flags that mean the same everywhere ---------------------------------------
def deltarun_process(*args: str | Path, stdin: str = "", timeout: int = 120) -> subprocess.CompletedProcess:
    """The real command through bash, so stdin can be closed (<&-) or empty (</dev/null)."""
    cmd = " ".join([f"'{sys.executable}'", "-m", "deltarun", *(f"'{a}'" for a in args)]) + " " + stdin
    return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("redirect, single, message", [
    ("<&-", False, "stdin is closed"), ("<&-", True, "stdin is closed"),
    ("</dev/null", False, "no message on stdin"), ("</dev/null", True, "--single: no message on stdin"),
])
def test_chat_without_input_is_one_clear_error(tiny_model, redirect, single, message):
    p = deltarun_process("chat", tiny_model, "-n", "1", *(["--single"] if single else []), stdin=redirect)
    assert p.returncode == 1 and p.stderr.startswith("error: ") and p.stderr.count("\n") == 1, p.stderr
    assert message in p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""


def test_bench_validates_before_printing(tiny_model, tmp_path):
    for args, code, text in ((["--backend", "cpu,quantum"], 5, "unknown backend 'quantum'"),
                             (["--backend", "vulkan:9"], 5, "vulkan"),
                             (["-t", "0"], 2, "Invalid value for '--threads'")):
        r = run("bench", tiny_model, "-p", "4", "-n", "2", "-r", "1", *args)
        assert r.exit_code == code and r.stdout == "", r.output
        assert r.stderr.startswith("error: ") and text.lower() in r.stderr.lower()
    r = run("bench", tmp_path / "missing.gguf", "-p", "4", "-n", "2", "-r", "1")
    assert r.exit_code == 2 and r.stdout == "" and r.stderr == f"error: {tmp_path / 'missing.gguf'}: no such file\n"
    for backend in ("cpu", "cpu-ref", "vulkan[:N]", "cuda[:N]", "auto"):
        assert backend in " ".join(ok("bench", "--help").stdout.split())


@pytest.mark.parametrize("args, code, text", [
    (["-p", "2147483648"], 2, "Invalid value for '--n-prompt'"),
    (["-t", "513"], 2, "Invalid value for '--threads'"),
    (["--parallel", "257"], 2, "Invalid value for '--parallel'"),
    (["-d", "2147483000", "-n", "1000"], 1, "need a context of 2147484000 tokens, above the longest, 2147483647"),
])
def test_bench_sizes_past_the_runtime_are_refused_before_the_work(tiny_model, args, code, text):
    """Each once aborted the process inside ggml (a tensor of more than 2^63 elements, a thread pool
    too large) or raised from numpy after the plain tests had run."""
    p = deltarun_process("bench", tiny_model, "-r", "1", *(["-p", "0", "-n", "2"] if args[0] != "-p" else []), *args)
    assert p.returncode == code and p.stdout == "" and p.stderr.count("\n") == 1, p.stderr[-2000:]
    assert text in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("command, args, option", [
    ("graph", ["--ctx", "2147483648"], "--ctx"), ("graph", ["--rs-slots", "257"], "--rs-slots"),
    ("graph", ["-t", "513"], "--threads"), ("compare", ["--tokens", "2147483648"], "--tokens"),
    ("compare", ["-t", "513"], "--threads"), ("inspect", ["--rs-slots", "257"], "--rs-slots"),
])
def test_every_command_bounds_the_sizes_alike(tiny_model, command, args, option):
    """The commands with options of their own take the same types as the model options."""
    r = run(command, tiny_model, *args)
    assert r.exit_code == 2 and r.stderr.startswith(f"error: Invalid value for '{option}'"), r.output


@pytest.mark.parametrize("kwargs, text", [
    ({"n_ctx": 2**63}, "--ctx must be between 1 and 2147483647"),
    ({"n_seq_max": 2**40}, "the number of sequences must be between 1 and 256"),
    ({"rs_slots": 2**62, "n_ubatch": 2**62}, "--rs-slots must be between 1 and 256"),
    ({"n_threads": 2**62}, "--threads must be between 1 and 512"),
])
def test_model_refuses_sizes_ggml_cannot_lay_out(tiny_model, kwargs, text):
    """The API's checks, behind the CLI's: in a child process, since ggml aborts the process on
    these sizes (GGML_ASSERT on a tensor's element count, std::bad_alloc for the thread pool)."""
    code = ("import sys; from deltarun.base.errors import DeltarunError; from deltarun.runner.model import Model\n"
            f"try: Model(sys.argv[1], **{kwargs!r})\n"
            "except DeltarunError as e: print(e); sys.exit(7)\n")
    p = subprocess.run([sys.executable, "-c", code, str(tiny_model)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 7 and text in p.stdout, (p.returncode, p.stdout, p.stderr[-2000:])


def test_a_failed_allocation_is_one_line_with_ggml_s_reason(tiny_model):
    """ggml prints two lines of its own when an allocation fails; they are held and its reason goes
    into deltarun's error. 256 sequences of 2^31 - 1 positions: 256 TiB of cache, past any address
    space, so the allocation fails whatever the kernel's overcommit policy."""
    code = ("import sys; from deltarun.base.errors import BackendError; from deltarun.runner.model import Model\n"
            "try: Model(sys.argv[1], n_ctx=2**31 - 1, n_seq_max=256, n_threads=1)\n"
            "except BackendError as e: print(e); sys.exit(7)\n")
    p = subprocess.run([sys.executable, "-c", code, str(tiny_model)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 7 and p.stderr == "", (p.returncode, p.stdout, p.stderr[-2000:])
    assert p.stdout.startswith("backend cpu could not allocate 256.00 TiB for the KV cache and recurrent state: ")
    assert "memory" in p.stdout and p.stdout.count("\n") == 1, p.stdout


def test_values_are_one_line_errors_and_malformed_lines_get_usage(tiny_model):
    bad_value = run("generate", tiny_model, "-p", "hi", "--top-p", "2")
    assert bad_value.exit_code == 2 and bad_value.stderr.count("\n") == 1
    assert bad_value.stderr.startswith("error: Invalid value for '--top-p'")
    malformed = run("generate", tiny_model, "--no-such-option")
    assert malformed.exit_code == 2 and malformed.stderr.startswith("Usage: ")


def test_verbose_after_the_command_name_shows_the_traceback(tmp_path):
    missing = tmp_path / "missing.gguf"
    for args in (["--verbose", "generate", missing, "-p", "hi"], ["generate", missing, "-p", "hi", "--verbose"]):
        r = run(*args)
        assert r.exit_code == 2 and "Traceback" in r.stderr and f"error: {missing}: no such file" in r.stderr
    assert "Traceback" not in run("generate", missing, "-p", "hi").stderr


def test_gpu_layers_on_the_cpu_says_it_has_no_effect(tiny_model):
    r = ok("generate", tiny_model, "-p", "hi", "-n", "1", "-ngl", "2", "--temp", "0", *FAST)
    assert "--gpu-layers has no effect on the CPU backend" in r.stderr
    assert "no effect" not in ok("generate", tiny_model, "-p", "hi", "-n", "1", "--temp", "0", *FAST).stderr


def test_n_minus_one_generates_until_the_context_is_full_in_generate_and_chat(tiny_model):
    r = ok("generate", tiny_model, "-p", PROMPT, "-n", "-1", "--temp", "0", "--ctx", "16", "--threads", "1")
    n_prompt = len(GGUFFile(tiny_model).tokenizer().encode(PROMPT))
    assert r.stdout == expected_text(tiny_model, PROMPT, 16 - n_prompt + 1, GREEDY) + "\n"
    assert "context full" in r.stderr
    c = CliRunner().invoke(cli, ["chat", str(tiny_model), "-n", "-1", "--temp", "0", "--ctx", "24", "--threads", "1"],
                           input="Hi\n")
    assert c.exit_code == 0 and "[context full: 24/24 tokens" in c.stderr


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_the_repeat_penalty_window_ends_with_the_newest_token(tiny_model_path, command):
    """llama.cpp's window: the last N tokens including the one just generated. The echo model
    repeats the last token; with N = 2 and a strong penalty the last two are out, so no token
    equals either of the two before it (a window one token late lets each token repeat once).
    The output is a greedy loop with the penalty worked out here in numpy."""
    from deltarun.apps.chat import ChatSession

    path = tiny_model_path("tiny-echo")
    n, last_n, penalty = 12, 2, 10.0
    with Model(path, n_ctx=256, n_threads=1, kv_type="f32") as m:
        if command == "generate":
            prompt = m.tokenizer.encode(PROMPT)
        else:
            prompt = ChatSession(m).prompt_tokens([{"role": "user", "content": PROMPT}])
        history, out = list(prompt), []
        logits = m.eval(prompt)
        for _ in range(n):
            x = logits.astype(np.float64)
            for t in set(history[-last_n:]):
                x[t] = x[t] / penalty if x[t] > 0 else x[t] * penalty
            t = int(np.argmax(x))
            if m.tokenizer.is_eog(t):
                break
            history.append(t)
            out.append(t)
            logits = m.eval([t])
        want = m.tokenizer.decode(out)
    assert len(out) == n and all(t not in history[i - last_n:i] for i, t in enumerate(out, len(prompt)))
    args = ["-n", str(n), "--temp", "0", "--repeat-penalty", str(penalty), "--repeat-last-n", str(last_n),
            "--kv-type", "f32", *FAST]
    if command == "generate":
        r = ok("generate", path, "-p", PROMPT, *args)
    else:
        r = CliRunner().invoke(cli, ["chat", str(path), *args], input=PROMPT + "\n")
        assert r.exit_code == 0, (r.output, r.exception)
    assert r.stdout_bytes.decode() == want + "\n"           # bytes: click's r.stdout turns \r\n into \n


def test_write_errors_name_the_users_path(tiny_model, tmp_path):
    target = tmp_path / "no-such-dir" / "graph.json"
    r = run("graph", tiny_model, "--format", "json", "-o", target)
    assert r.exit_code == 7 and r.stderr == f"error: {target}: No such file or directory\n"


# --- README -------------------------------------------------------------------------------------
REPO = Path(__file__).resolve().parents[1]


def _blocks(text: str, lang: str) -> list[str]:
    import re

    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_readme_setup_is_what_ci_runs():
    readme = (REPO / "README.md").read_text()
    setup = readme.split("## Set up", 1)[1]
    commands = _blocks(setup, "sh")[0].strip().splitlines()
    assert commands == ["scripts/install.sh", "python -m pytest -q"]
    install = (REPO / "scripts" / "install.sh").read_text()
    assert "pip install -q -e \"$REPO[test]\"" in install and "-DGGML_LLAMAFILE=ON" in install
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert "set -euo pipefail" in ci
    assert [line for line in ci if line in commands] == commands


def test_readme_python_example_runs(tiny_model, capsys):
    readme = (REPO / "README.md").read_text()
    code = _blocks(readme.split("## Python API", 1)[1], "python")[0]
    assert len(code.strip().splitlines()) <= 7
    code = code.replace('"model.gguf"', repr(str(tiny_model))).replace("n_ctx=4096", "n_ctx=4096, n_threads=1")
    exec(compile(code, "README.md", "exec"), {})
    assert capsys.readouterr().out.strip()


@pytest.mark.parametrize("draft,expected", [("mtp", 3), ("ngram", 8), ("mtp --draft-max 2", 2)])
def test_draft_max_defaults_to_the_source(tiny_model_path, draft, expected):
    """--draft-max: 3 with mtp (llama.cpp's MTP depth), 8 for the other sources, what the user gives
    otherwise; the value reaches the run (stderr's speculative line)."""
    r = ok("generate", tiny_model_path("tiny-echo"), "-p", PROMPT, "-n", "4", "--temp", "0", *FAST,
           "--draft", *draft.split())
    assert f"draft-max {expected}:" in r.stderr
