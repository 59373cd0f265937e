"""GGUF parsing: header, KV metadata and tensor infos, without touching tensor data.

:class:`HeaderLimits` is imported here; the reader and its value types with their first
use (the service starts without them)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value
