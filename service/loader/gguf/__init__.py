"""GGUF parsing: header, KV metadata and tensor infos, without touching tensor data."""

from service.loader.gguf.reader import GGUFFile, HeaderLimits, KVEntry, TensorInfo, read_gguf
from service.loader.gguf.values import GGUFArray, GGUFFloat, GGUFString

__all__ = ["GGUFArray", "GGUFFile", "GGUFFloat", "GGUFString", "HeaderLimits", "KVEntry", "TensorInfo", "read_gguf"]
