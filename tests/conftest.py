"""Shared fixtures: synthetic models written once per test session.

`tiny_model_path(preset, wtype, seed=0, **changes)` returns the path of a synthetic Qwen3-Next GGUF,
writing it on first request and reusing it for the rest of the session:

    def test_something(tiny_model_path):
        path = tiny_model_path("tiny", "q8_0")
        legacy = tiny_model_path("tiny-legacy")                  # f32
        mtp_q4 = tiny_model_path("tiny", "q4_k", n_mtp=1)        # preset fields changed

Files are shared between tests: treat them as read-only (copy one before changing it).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import pytest

TinyModelPath = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's folder of generated models."""
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def tiny_model_path(tiny_model_dir: Path) -> TinyModelPath:
    """Factory: (preset="tiny", wtype="f32", seed=0, **config changes) -> path of the written GGUF."""
    from deltarun.model_files import generate as gen
    from deltarun.model_files import kimi_linear, qwen35, qwen4exp

    cache: dict[tuple, Path] = {}

    def get(preset: str = "tiny", wtype: str = "f32", seed: int = 0, **changes: object) -> Path:
        # Qwen3.5 presets: models/qwen35.py; Kimi-Linear: models/kimi_linear.py; Qwen3.8-Flash-Next:
        # models/qwen4exp.py
        family = next((f for f in (qwen35, kimi_linear, qwen4exp) if preset in f.PRESETS), gen)
        if preset not in family.PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose from "
                             f"{', '.join([*gen.PRESETS, *qwen35.PRESETS, *kimi_linear.PRESETS, *qwen4exp.PRESETS])}")
        if wtype not in gen.WEIGHT_TYPES:
            raise ValueError(f"unknown weight type {wtype!r}; choose from {', '.join(gen.WEIGHT_TYPES)}")
        key = (preset, wtype, seed, tuple(sorted(changes.items())))
        path = cache.get(key)
        if path is None:
            if family is not gen:
                cfg = family.config_with(preset, **changes)
            else:
                cfg = dataclasses.replace(gen.PRESETS[preset], **changes) if changes else gen.PRESETS[preset]
            suffix = "".join(f"-{k}={v}" for k, v in sorted(changes.items()))
            path = family.write_model(tiny_model_dir / f"{preset}-{wtype}-s{seed}{suffix}.gguf", cfg, wtype, seed)
            cache[key] = path
        return path

    return get


@pytest.fixture(scope="session")
def tiny_model(tiny_model_path: TinyModelPath) -> Path:
    """The default test model: preset tiny, Q8_0 (random weights, exact shapes; not the built-in trained model)."""
    return tiny_model_path("tiny", "q8_0")
