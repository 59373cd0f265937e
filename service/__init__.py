"""hoist: load GGUF model weights onto devices the way llama.cpp does, over HTTP."""

__version__ = "0.1.0"
