"""A process that opens a model runs without numpy's huge-page advice (runner/host_memory.py: in
a server the advice, taken by big logits arrays, made later page faults compact memory)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltarun.cli.options import open_model
from deltarun.runner import host_memory
from deltarun.runner.host_memory import hugepage_advice_on


@pytest.fixture
def advice_restored():
    switch = host_memory._madvise_switch()
    if switch is None:
        pytest.skip("this numpy has no huge-page advice to turn off")
    was = switch(True)
    yield switch
    switch(was)


def test_opening_a_model_turns_the_advice_off(tiny_model: Path, advice_restored) -> None:
    assert hugepage_advice_on()            # numpy's default, set again by the fixture
    with open_model(tiny_model, quiet=True):
        assert not hugepage_advice_on()


def test_the_query_leaves_the_setting_as_it_was(advice_restored) -> None:
    advice_restored(False)
    assert not hugepage_advice_on() and not hugepage_advice_on()
    advice_restored(True)
    assert hugepage_advice_on() and hugepage_advice_on()
