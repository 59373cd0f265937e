"""The model repository: the GGUF files under the models directory, each with a short
summary of its header (as Ollama's ``/api/tags`` and Triton's repository index list
what can be loaded).

The walk is bounded (depth and directory entries) and reads no file; summaries parse
headers only, within the service's header limits, and are cached by the files'
identity (device, inode, size, modification time of every split), so that listing a
page again costs a ``stat`` per file. A split model is listed once, by its first split.
"""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from service.api.errors import public_error
from service.cancel import CancelToken, check
from service.errors import HoistError, RequestAbandonedError, WorkLimitError, clip
from service.loader.file_types import file_type_name
from service.loader.gguf import HeaderLimits
from service.loader.gguf.limits import file_identity

MAX_DEPTH = 8
"""Directory levels below the models directory that are walked."""

MAX_ENTRIES = 100_000
"""Directory entries examined by one walk; beyond, the listing says it was truncated."""

MAX_ARCHITECTURE = 64
"""Characters of ``general.architecture`` a summary gives (llama.cpp's names are short;
a file may declare megabytes)."""

CACHE_ENTRIES = 4096
"""Summaries kept (least recently used dropped first)."""

_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")

Identity = tuple[tuple[int, int, int, int] | None, ...]


@dataclass(frozen=True, slots=True)
class Walk:
    """What a walk found: model paths relative to the models directory (sorted), paths
    whose symbolic link leads outside it, and whether a limit stopped it."""

    paths: list[str]
    outside: frozenset[str]
    truncated: bool


def _inside(root: str, path: str) -> bool:
    return os.path.commonpath([root, os.path.realpath(path)]) == root


def walk(models_dir: str, cancel: CancelToken | None = None) -> Walk:
    """The ``.gguf`` files under ``models_dir``, at most :data:`MAX_DEPTH` levels down
    and :data:`MAX_ENTRIES` entries examined; splits other than the first are left out.
    Symbolic links to directories are not followed; a file reached through a link that
    leads outside the directory is listed as such (it is never opened).

    Raises:
        RequestAbandonedError, WorkLimitError: from ``cancel``.
    """
    root = os.path.realpath(models_dir)
    paths: list[str] = []
    outside: set[str] = set()
    seen = 0
    truncated = full = False
    stack: list[tuple[str, int]] = [(root, 0)]
    while stack and not full:
        directory, depth = stack.pop()
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    seen += 1
                    if seen & 1023 == 0:
                        check(cancel)
                    if seen > MAX_ENTRIES:
                        truncated = full = True
                        break
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            if depth < MAX_DEPTH:
                                stack.append((entry.path, depth + 1))
                            else:
                                truncated = True  # deeper levels are left out, the rest walked
                            continue
                        if not entry.name.endswith(".gguf") or not entry.is_file():
                            continue
                    except OSError:
                        continue
                    split = _SPLIT.search(entry.name)
                    if split is not None and split.group(1) != "00001":
                        continue
                    rel = os.path.relpath(entry.path, root)
                    paths.append(rel)
                    if entry.is_symlink() and not _inside(root, entry.path):
                        outside.add(rel)
        except OSError:
            continue  # unreadable or vanished: nothing to list there
    paths.sort()
    return Walk(paths, frozenset(outside), truncated)


class Summaries:
    """Header summaries of model files, cached by their files' identity.

    Args:
        models_dir: the models directory.
        limits: the header limits of the service (a file over them is listed with the
            error).
    """

    def __init__(self, models_dir: str, limits: HeaderLimits) -> None:
        self.root = os.path.realpath(models_dir)
        self.limits = limits
        self._cache: OrderedDict[tuple[str, Identity], dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def _identity(self, rel: str) -> Identity:
        """The identity of the file and, for a split name, of each sibling its name
        promises (None for a missing one), bounded by the split limit."""
        path = os.path.join(self.root, rel)
        names = [path]
        split = _SPLIT.search(path)
        if split is not None:
            count = int(split.group(2))
            if 1 < count <= (self.limits.max_splits or 65535):
                prefix = path[: split.start()]
                names += [f"{prefix}-{i:05d}-of-{count:05d}.gguf" for i in range(2, count + 1)]
        out: list[tuple[int, int, int, int] | None] = []
        for name in names:
            try:
                out.append(file_identity(os.stat(name)))
            except OSError:
                out.append(None)
        return tuple(out)

    def summary(self, rel: str, *, outside: bool = False, cancel: CancelToken | None = None) -> dict[str, Any]:
        """The summary of the model file ``rel`` (relative to the models directory):
        architecture, file type, bytes of all splits, parameters, tensors and splits; or,
        for a file that cannot be read as a model, its size and the error (``code``,
        ``message``). ``outside``: the file is a link leading out of the directory, and
        is not opened.

        Raises:
            RequestAbandonedError, WorkLimitError: from ``cancel``.
        """
        empty: dict[str, Any] = {
            "path": rel,
            "architecture": None,
            "file_type": None,
            "file_type_name": None,
            "size_bytes": None,
            "n_params": None,
            "n_tensors": None,
            "n_splits": None,
            "error": None,
        }
        if outside:
            message = f"model path '{rel}' leaves the models directory (through a symbolic link)"
            return {**empty, "error": {"code": "invalid_request", "message": message}}
        key = (rel, self._identity(rel))
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        from service.loader.weights import open_model

        try:
            index = open_model(os.path.join(self.root, rel), root=self.root, cancel=cancel, limits=self.limits)
        except (RequestAbandonedError, WorkLimitError):
            raise
        except HoistError as exc:
            error = public_error(exc, self.root)
            sizes = [i[2] for i in key[1] if i is not None]
            out = {**empty, "size_bytes": sum(sizes) if sizes else None}
            out["error"] = {"code": error["code"], "message": error["message"]}
        else:
            meta = index.metadata
            file_type = meta.get("general.file_type")
            if isinstance(file_type, bool) or not isinstance(file_type, int):
                file_type = None
            architecture = meta.get("general.architecture")
            out = {
                **empty,
                "architecture": clip(architecture, MAX_ARCHITECTURE) if isinstance(architecture, str) else None,
                "file_type": file_type,
                "file_type_name": file_type_name(file_type, (w.info.ggml_type.name for w in index.weights.values())),
                "size_bytes": sum(f.file_size for f in index.files),
                "n_params": index.n_elements,
                "n_tensors": len(index),
                "n_splits": len(index.files),
            }
        with self._lock:
            self._cache[key] = out
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return out

    def page(self, offset: int, limit: int, cancel: CancelToken | None = None) -> dict[str, Any]:
        """``limit`` files from ``offset`` of a fresh walk, summarised, with ``total``
        and ``truncated``. Raises as :meth:`summary`."""
        found = walk(self.root, cancel)
        data = []
        for rel in found.paths[offset : offset + limit]:
            check(cancel)
            data.append(self.summary(rel, outside=rel in found.outside, cancel=cancel))
        return {"data": data, "total": len(found.paths), "truncated": found.truncated}
