"""One error hierarchy, so the CLI can turn any expected failure into one clear line."""

from __future__ import annotations


class DeltarunError(Exception):
    """Base of every error deltarun raises on purpose; the CLI prints it without a traceback."""

    exit_code = 1


class ModelFileError(DeltarunError):
    """The GGUF file is unreadable, truncated, or inconsistent with its own metadata."""

    exit_code = 2


class UnsupportedModelError(DeltarunError):
    """The file is a valid GGUF but describes something deltarun cannot run."""

    exit_code = 3


class TokenizerError(DeltarunError):
    """The vocabulary or chat template stored in the model cannot be used."""

    exit_code = 2


class ContextFullError(DeltarunError):
    """The request needs more context than was allocated."""

    exit_code = 4


class RollbackError(DeltarunError):
    """A rollback asked for more tokens than the recurrent slots hold."""

    exit_code = 4


class BackendError(DeltarunError):
    """A ggml backend is missing, unavailable, or refused an allocation."""

    exit_code = 5


class ImageError(DeltarunError):
    """An image that cannot be used: unreadable, corrupt, truncated, of another format, too large, or
    given to a model without a vision tower."""

    exit_code = 2
