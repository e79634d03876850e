"""Run-time faults end in deltarun's own errors, and nothing the user wrote is lost or half-written."""

from __future__ import annotations

import errno
import os

import pytest
from click.testing import CliRunner

from deltarun.apps.chat import ChatSession
from deltarun.base.errors import BackendError, ContextFullError
from deltarun.cli.main import cli
from deltarun.runner import files
from deltarun.runner.model import Model


def greedy_answers(path, messages: list[str], n: int) -> str:
    """What `deltarun chat PATH -n N --temp 0 --ctx 64` prints for these messages."""
    with Model(path, n_ctx=64, n_threads=1) as m:
        session = ChatSession(m, n_predict=n)
        return "".join(session.ask(text) + "\n" for text in messages)


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_full_disk_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "conversation.json"
    target.write_text('{"old": true}')
    monkeypatch.setattr(files.os, "fsync", _disk_full)
    with pytest.raises(OSError) as e:
        files.write_atomically(target, b'{"new": true}')
    assert e.value.errno == errno.ENOSPC
    assert target.read_text() == '{"old": true}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conversation.json"]


def test_chat_save_on_a_full_disk_says_so_and_the_chat_goes_on(tiny_model_path, tmp_path, monkeypatch):
    saved = tmp_path / "chat.json"
    saved.write_text("[]")
    monkeypatch.setattr(files.os, "fsync", _disk_full)
    result = CliRunner().invoke(cli, ["chat", str(tiny_model_path("tiny")), "-n", "3", "--threads", "1",
                                      "--temp", "0", "--ctx", "64"], input=f"hello\n/save {saved}\nagain\n")
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    assert f"error: cannot save the conversation to {saved}: No space left on device" in result.stderr
    assert saved.read_text() == "[]"
    assert result.stdout == greedy_answers(tiny_model_path("tiny"), ["hello", "again"], 3)   # it went on
    assert [p.name for p in tmp_path.iterdir()] == ["chat.json"]


def test_graph_dump_on_a_full_disk_is_one_clear_error(tiny_model_path, tmp_path, monkeypatch):
    out = tmp_path / "graph.json"
    monkeypatch.setattr(files.os, "fsync", _disk_full)
    result = CliRunner().invoke(cli, ["graph", str(tiny_model_path("tiny")), "--format", "json", "-o", str(out)])
    assert result.exit_code != 0
    assert "Traceback" not in result.output and "No space left on device" in result.output
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_prompt_longer_than_the_context(tiny_model_path):
    with Model(tiny_model_path("tiny"), n_ctx=16) as m:
        with pytest.raises(ContextFullError, match="context"):
            m.eval(list(range(20)))
        assert m.n_past() == 0                      # nothing was evaluated
    result = CliRunner().invoke(cli, ["generate", str(tiny_model_path("tiny")), "-p", "word " * 40, "-n", "2",
                                      "--ctx", "16"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "context" in result.output


def test_an_allocation_the_backend_refuses_reports_its_size(tiny_model_path):
    """A KV cache far beyond the machine's memory: the backend says no, deltarun says how much."""
    with pytest.raises(BackendError, match=r"could not allocate \d+\.\d\d TiB for the KV cache"):
        Model(tiny_model_path("tiny"), n_ctx=(1 << 31) - 1, n_seq_max=256, kv_type="f32")
    result = CliRunner().invoke(cli, ["generate", str(tiny_model_path("tiny")), "-p", "hi", "-n", "1",
                                      "--ctx", str((1 << 31) - 1)])
    assert result.exit_code == BackendError.exit_code and "Traceback" not in result.output


def test_unknown_backend_is_a_clear_error(tiny_model_path):
    result = CliRunner().invoke(cli, ["generate", str(tiny_model_path("tiny")), "-p", "hi", "-n", "1",
                                      "--backend", "tpu"])
    assert result.exit_code == BackendError.exit_code
    assert "tpu" in result.output and "Traceback" not in result.output


def test_load_of_a_missing_or_broken_conversation(tiny_model_path, tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    result = CliRunner().invoke(cli, ["chat", str(tiny_model_path("tiny")), "-n", "4", "--threads", "1",
                                      "--temp", "0", "--ctx", "64"],
                                input=f"/load {tmp_path / 'missing.json'}\n/load {broken}\nhi\n")
    assert result.exit_code == 0 and "Traceback" not in result.output
    assert f"error: cannot load {tmp_path / 'missing.json'}: no such file" in result.stderr
    assert f"error: cannot load {broken}: not valid JSON" in result.stderr
    # the chat answered after both errors, as a fresh conversation would
    assert result.stdout == greedy_answers(tiny_model_path("tiny"), ["hi"], 4)
