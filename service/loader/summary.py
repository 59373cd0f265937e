"""What ``hoist inspect`` shows of a model: format, type, size, BPW, metadata, tensors."""

from __future__ import annotations

import json
import math
import struct
from collections import Counter
from typing import TYPE_CHECKING, Any, TextIO

from service.loader.file_types import file_type_name
from service.loader.gguf import GGUFArray, GGUFFloat, GGUFString
from service.loader.gguf.constants import GGUFValueType
from service.loader.gguf.values import is_utf8
from service.loader.weights import WeightIndex

if TYPE_CHECKING:
    import numpy as np

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


_FLOAT_ARRAYS = (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64)


def nonfinite_text(bits: int, width: int) -> str:
    """How JSON shows a float that is not finite: ``nan``, ``inf`` or ``-inf``, a colon and
    the bit pattern in hex at the value's width (``nan:0x7f861e36``, ``-inf:0xfff0000000000000``)."""
    exponent_bits = 8 if width == 4 else 11
    mantissa = bits & ((1 << (8 * width - 1 - exponent_bits)) - 1)
    negative = bits >> (8 * width - 1)
    kind = "nan" if mantissa else ("-inf" if negative else "inf")
    return f"{kind}:0x{bits:0{2 * width}x}"


def float_json(value: float) -> float | str:
    """A float as JSON data, bit-exact: a finite value is a number (read back and rounded to
    the value's width it gives the same bits); NaN and infinities, which JSON cannot hold,
    are strings with their bit pattern (:func:`nonfinite_text`). A plain ``float`` counts
    as 8 bytes wide."""
    if math.isfinite(value):
        return float(value)
    if isinstance(value, GGUFFloat):
        return nonfinite_text(value.bits, value.width)
    return nonfinite_text(struct.unpack("<Q", struct.pack("<d", value))[0], 8)


def _json_scalar(value: Any) -> Any:
    if isinstance(value, float):
        return float_json(value)
    if isinstance(value, GGUFString):
        return str(value)
    return value


def value_json(value: Any, *, max_items: int | None = None) -> Any:
    """A KV value as JSON data; arrays cut to ``max_items`` elements when given. Floats
    are given by :func:`float_json`; strings as text, invalid UTF-8 shown as U+FFFD (see
    :func:`raw_hex` for their bytes)."""
    if isinstance(value, GGUFArray):
        items = value.to_list() if max_items is None else value.head(max_items)
        return [_json_scalar(v) for v in items]
    return _json_scalar(value)


def raw_hex(value: Any, *, max_items: int | None = None) -> str | dict[str, str] | None:
    """The exact bytes of the strings of a KV value that are not valid UTF-8, in hex: for a
    STRING value, its bytes; for a string array, element index -> bytes of each such
    element (among the first ``max_items`` when given); ``None`` when every string is
    valid UTF-8 (the text is then exact)."""
    if isinstance(value, GGUFString):
        return None if value.valid_utf8 else value.raw.hex()
    if isinstance(value, GGUFArray) and value.element_type == GGUFValueType.STRING:
        invalid: dict[str, str] = {}
        for i, raw in enumerate(value.iter_string_bytes()):
            if max_items is not None and i >= max_items:
                break
            if not is_utf8(raw):
                invalid[str(i)] = raw.hex()
        return invalid or None
    return None


def _json_floats(values: np.ndarray[Any, Any], bits: np.ndarray[Any, Any]) -> list[Any]:
    """Float array elements as JSON data, bit-exact (see :func:`float_json`)."""
    import numpy as np

    out: list[Any] = values.tolist()
    width = values.dtype.itemsize
    for i in np.flatnonzero(~np.isfinite(values)).tolist():
        out[i] = nonfinite_text(int(bits[i]), width)
    return out


_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x20), *range(0x7F, 0xA0)]}


def printable(text: str) -> str:
    """``text`` with control characters (escape sequences, newlines) written as ``\\xNN``,
    so that names and values from a file cannot drive the terminal."""
    return text.translate(_CONTROL)


def _scalar_text(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(float_json(value))
    if isinstance(value, str):
        return repr(str(value))
    return repr(value)


def value_text(value: Any, *, max_items: int = 8) -> str:
    """A KV value shortened for a table: long arrays show their head and length; NaN and
    infinities with their bits as in JSON."""
    if isinstance(value, GGUFArray):
        head = ", ".join(_scalar_text(v) for v in value.head(max_items))
        more = f", ... ({value.count} items)" if value.count > max_items else ""
        return printable(f"[{head}{more}]")
    if isinstance(value, str):
        return printable(repr(str(value) if len(value) <= 120 else value[:117] + "..."))
    if isinstance(value, float) and not math.isfinite(value):
        return str(float_json(value))
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
            out.write(json.dumps([_json_scalar(v) for v in data], allow_nan=False))
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
            bits = data.float_bits() if data.element_type in _FLOAT_ARRAYS else None
            for start in range(0, len(values), _CHUNK):
                part = slice(start, start + _CHUNK)
                chunk = values[part].tolist() if bits is None else _json_floats(values[part], bits[part])
                out.write(("," if start else "") + json.dumps(chunk, allow_nan=False)[1:-1])
        out.write("]")
    else:
        out.write(json.dumps(_json_scalar(data), allow_nan=False))


def _kv_json(key: str, type_name: str, value: Any, max_items: int | None, lazy_arrays: bool) -> dict[str, Any]:
    """One metadata entry: ``key``, ``type``, ``value`` and, when a string in it is not
    valid UTF-8, ``raw_hex`` (:func:`raw_hex`)."""
    entry: dict[str, Any] = {
        "key": key,
        "type": type_name,
        "value": value
        if lazy_arrays and max_items is None and isinstance(value, GGUFArray)
        else value_json(value, max_items=max_items),
    }
    raw = raw_hex(value, max_items=max_items)
    if raw is not None:
        entry["raw_hex"] = raw
    return entry


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
        "metadata": [_kv_json(e.key, e.type_name, e.value, max_items, lazy_arrays) for e in meta.kv.values()],
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
