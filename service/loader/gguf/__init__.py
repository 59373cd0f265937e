"""GGUF parsing: header, KV metadata and tensor infos, without touching tensor data.

:class:`HeaderLimits` is imported here; the reader and its value types with their first
use (the service starts without them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.lazy import lazy_exports
from service.loader.gguf.limits import HeaderLimits

if TYPE_CHECKING:
    from service.loader.gguf.reader import GGUFFile, KVEntry, TensorInfo, read_gguf
    from service.loader.gguf.values import GGUFArray, GGUFFloat, GGUFString

__all__ = ["GGUFArray", "GGUFFile", "GGUFFloat", "GGUFString", "HeaderLimits", "KVEntry", "TensorInfo", "read_gguf"]

_HOME = {
    "GGUFFile": "reader",
    "KVEntry": "reader",
    "TensorInfo": "reader",
    "read_gguf": "reader",
    "GGUFArray": "values",
    "GGUFFloat": "values",
    "GGUFString": "values",
}
"""The module of this package that defines each lazily exported name."""


__getattr__ = lazy_exports(__name__, _HOME)
