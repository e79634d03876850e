"""Applications built on the runtime core: chat sessions, speculative decoding, backend comparison,
benchmarks, graph dumps and perplexity.

They use only the public API of `deltarun.runner` (`Model`, `Memory`, the sampler, the decode
loop) and of `deltarun.base` (the tokenizer, the GGUF file, ubatch shapes); the core never imports
from here.
"""
