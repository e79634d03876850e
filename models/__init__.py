"""Generator of small synthetic Qwen3-Next GGUF models (installed as deltarun.models)."""
