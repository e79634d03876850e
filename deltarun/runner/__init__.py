"""Model runtime: GGUF loading, tokenizer, memory, backends, sessions, sampling."""
