"""GGUF parsing: header, KV metadata and tensor infos, without touching tensor data."""

from service.loader.gguf.reader import GGUFFile, HeaderLimits, KVEntry, TensorInfo, read_gguf
from service.loader.gguf.values import GGUFArray

__all__ = ["GGUFArray", "GGUFFile", "HeaderLimits", "KVEntry", "TensorInfo", "read_gguf"]
