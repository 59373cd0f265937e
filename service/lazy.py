"""Lazily exported names of a package: each is imported from the submodule that defines
it on first use, so that importing the package costs nothing it does not use."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports each name of ``homes`` (name
    -> submodule of ``package`` defining it) on first use and keeps it in the package's
    namespace.

    Raises (from the returned function):
        AttributeError: the name is not one of ``homes``.
    """
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{home}"), name)
        namespace[name] = value
        return value

    return __getattr__
