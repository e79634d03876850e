"""Model files and their generators: synthetic GGUF models written like the converter's output
(installed as deltarun.model_files)."""
