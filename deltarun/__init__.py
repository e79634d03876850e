"""deltarun: run Qwen3-Next GGUF models through real ggml compute graphs."""

__version__ = "0.1.0"
