"""What ``hoist inspect`` shows of a model: format, type, size, BPW, metadata, tensors."""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any, TextIO

from gguf import GGUFValueType

from service.loader.file_types import file_type_name
from service.loader.gguf import GGUFArray
from service.loader.weights import WeightIndex

MiB = 1 << 20
GiB = 1 << 30

_VERSION_NAMES = {1: "GGUF V1 (support until nov 2023)", 2: "GGUF V2", 3: "GGUF V3 (latest)"}


def file_format(version: int) -> str:
    """llama.cpp's name of a GGUF version (``GGUF V3 (latest)``)."""
    return _VERSION_NAMES.get(version, f"GGUF V{version}")


def size_text(nbytes: int, n_elements: int) -> str:
    """llama.cpp's ``file size`` figure: MiB below 1 GiB, GiB above, with BPW."""
    bpw = nbytes * 8 / n_elements if n_elements else 0.0
    if nbytes < GiB:
        return f"{nbytes / MiB:.2f} MiB ({bpw:.2f} BPW)"
    return f"{nbytes / GiB:.2f} GiB ({bpw:.2f} BPW)"


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: such floats become the strings ``nan``, ``inf``, ``-inf``."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def value_json(value: Any, *, max_items: int | None = None) -> Any:
    """A KV value as JSON data; arrays cut to ``max_items`` elements when given."""
    if isinstance(value, GGUFArray):
        items = value.to_list() if max_items is None else value.head(max_items)
        if value.element_type in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
            return [_finite(v) for v in items]
        return items
    return _finite(value)


_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7F, 0xA0)]}


def printable(text: str) -> str:
    """``text`` with control characters (escape sequences, newlines) written as ``\\xNN``,
    so that names and values from a file cannot drive the terminal."""
    return text.translate(_CONTROL)


def value_text(value: Any, *, max_items: int = 8) -> str:
    """A KV value shortened for a table: long arrays show their head and length."""
    if isinstance(value, GGUFArray):
        head = ", ".join(repr(v) for v in value.head(max_items))
        more = f", ... ({value.count} items)" if value.count > max_items else ""
        return printable(f"[{head}{more}]")
    if isinstance(value, str):
        return printable(repr(value if len(value) <= 120 else value[:117] + "..."))
    return str(value)


_CHUNK = 1 << 16


def write_json(data: Any, out: TextIO, *, indent: int = 0) -> None:
    """Write ``data`` (JSON-ready values, where metadata arrays may be left as
    :class:`GGUFArray`) to ``out`` as JSON, streaming arrays in chunks so that a huge
    vocabulary never exists as one list of Python objects or one string."""
    pad = " " * indent
    if isinstance(data, dict):
        if not data:
            out.write("{}")
            return
        out.write("{\n")
        for i, (key, value) in enumerate(data.items()):
            out.write(f"{pad} {json.dumps(str(key))}: ")
            write_json(value, out, indent=indent + 1)
            out.write(",\n" if i + 1 < len(data) else "\n")
        out.write(pad + "}")
    elif isinstance(data, list | tuple):
        if not data or all(not isinstance(v, dict | list | tuple | GGUFArray) for v in data):
            out.write(json.dumps([_finite(v) for v in data], allow_nan=False))
            return
        out.write("[\n")
        for i, value in enumerate(data):
            out.write(pad + " ")
            write_json(value, out, indent=indent + 1)
            out.write(",\n" if i + 1 < len(data) else "\n")
        out.write(pad + "]")
    elif isinstance(data, GGUFArray):
        out.write("[")
        if data.element_type == GGUFValueType.STRING:
            for i, raw in enumerate(data.iter_string_bytes()):
                out.write(("," if i else "") + json.dumps(raw.decode("utf-8", "replace")))
        else:
            values = data.numpy()
            for start in range(0, len(values), _CHUNK):
                chunk = [_finite(v) for v in values[start : start + _CHUNK].tolist()]
                out.write(("," if start else "") + json.dumps(chunk, allow_nan=False)[1:-1])
        out.write("]")
    else:
        out.write(json.dumps(_finite(data), allow_nan=False))


def summarize(index: WeightIndex, *, max_items: int | None = None, lazy_arrays: bool = False) -> dict[str, Any]:
    """The model's description as JSON-ready data.

    Args:
        index: the model.
        max_items: cut array values to this many elements (None: full arrays).
        lazy_arrays: leave full array values as :class:`GGUFArray` (for :func:`write_json`).
    """
    meta = index.metadata
    file_type = meta.get("general.file_type")
    if isinstance(file_type, bool) or not isinstance(file_type, int):
        file_type = None
    architecture = meta.get("general.architecture")
    types = Counter(w.info.ggml_type.name for w in index.weights.values())
    return {
        "path": index.path,
        "file_format": file_format(meta.version),
        "version": meta.version,
        "byte_order": meta.byte_order,
        "architecture": architecture if isinstance(architecture, str) else None,
        "file_type": file_type,
        "file_type_name": file_type_name(file_type, (w.info.ggml_type.name for w in index.weights.values())),
        "file_size_bytes": sum(f.file_size for f in index.files),
        "n_tensors": len(index),
        "n_elements": index.n_elements,
        "tensor_bytes": index.nbytes,
        "size": size_text(index.nbytes, index.n_elements),
        "bpw": round(index.bpw, 4),
        "tensor_types": dict(sorted(types.items(), key=lambda kv: (-kv[1], kv[0]))),
        "alignment": meta.alignment,
        "splits": [
            {
                "index": i,
                "path": f.path,
                "file_size_bytes": f.file_size,
                "data_offset": f.data_offset,
                "n_tensors": len(f.tensors),
            }
            for i, f in enumerate(index.files)
        ],
        "metadata": [
            {
                "key": e.key,
                "type": e.type_name,
                "value": e.value
                if lazy_arrays and max_items is None and isinstance(e.value, GGUFArray)
                else value_json(e.value, max_items=max_items),
            }
            for e in meta.kv.values()
        ],
        "tensors": [
            {
                "name": w.name,
                "type": w.info.ggml_type.name,
                "ne": list(w.info.ne),
                "bytes": w.nbytes,
                "split": w.file_index,
                "offset": w.offset,
            }
            for w in index.weights.values()
        ],
    }
