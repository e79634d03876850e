"""Training the built-in model: a small Qwen3-Next (with one MTP block) trained on Shakespeare.

The runtime never imports this package: it needs torch and HF `tokenizers` (the optional `train`
extra). `python -m deltarun.model_files.train --help` runs it; see `models/trained-shakespeare.md`
for the recipe and what it produced.

Modules: `corpus` (the texts and their held-out split), `bpe` (the byte-level BPE vocabulary),
`net` (the model in torch, written from the same math as tests/reference.py), `export` (GGUF in
the converter's layout), `run` (the training loop and command line).
"""
