"""GGUF fixtures written with the gguf package's writer (or as raw bytes, where the gguf
package's sizes lag ggml's), and what they contain. Block sizes come from hoist's ggml
type table."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

# one value of every scalar type, and arrays of every element type
ALL_VALUE_TYPES: list[tuple[str, Any, V, V | None]] = [
    ("test.u8", 200, V.UINT8, None),
    ("test.i8", -100, V.INT8, None),
    ("test.u16", 60000, V.UINT16, None),
    ("test.i16", -30000, V.INT16, None),
    ("test.u32", 4_000_000_000, V.UINT32, None),
    ("test.i32", -2_000_000_000, V.INT32, None),
    ("test.f32", 1.5, V.FLOAT32, None),
    ("test.bool_true", True, V.BOOL, None),
    ("test.bool_false", False, V.BOOL, None),
    ("test.string", "héllo, wörld ✓", V.STRING, None),
    ("test.empty_string", "", V.STRING, None),
    ("test.u64", 18_000_000_000_000_000_000, V.UINT64, None),
    ("test.i64", -9_000_000_000_000_000_000, V.INT64, None),
    ("test.f64", -2.25e300, V.FLOAT64, None),
    ("test.arr_u8", [0, 1, 255], V.ARRAY, V.UINT8),
    ("test.arr_i8", [-128, 0, 127], V.ARRAY, V.INT8),
    ("test.arr_u16", [0, 65535], V.ARRAY, V.UINT16),
    ("test.arr_i16", [-32768, 32767], V.ARRAY, V.INT16),
    ("test.arr_u32", [1, 2, 3, 4_294_967_295], V.ARRAY, V.UINT32),
    ("test.arr_i32", [-1, 0, 1], V.ARRAY, V.INT32),
    ("test.arr_f32", [0.5, -0.25, 3.0], V.ARRAY, V.FLOAT32),
    ("test.arr_bool", [True, False, True], V.ARRAY, V.BOOL),
    ("test.arr_str", ["a", "", "ünïcode", "x" * 300], V.ARRAY, V.STRING),
    ("test.arr_u64", [0, 2**64 - 1], V.ARRAY, V.UINT64),
    ("test.arr_i64", [-(2**63), 2**63 - 1], V.ARRAY, V.INT64),
    ("test.arr_f64", [1e-300, -1e300], V.ARRAY, V.FLOAT64),
]


@dataclass
class Fixture:
    """A GGUF file written for a test, and what was written into it."""

    path: Path
    kv: list[tuple[str, Any, V, V | None]]
    tensors: dict[str, tuple[np.ndarray, Q]] = field(default_factory=dict)
    alignment: int = 32


def type_sizes(qtype: int) -> tuple[int, int]:
    """(block size, type size) of the ggml type id ``qtype``, from hoist's table."""
    from service.loader.ggml_types import GGML_TYPES

    t = GGML_TYPES[int(qtype)]
    return t.block_size, t.type_size


def quantized_bytes(rng: np.random.Generator, qtype: int, rows: int, cols: int) -> np.ndarray:
    """Random block bytes of a ``rows x cols`` tensor of ``qtype``, shaped (rows, row bytes)."""
    block, size = type_sizes(qtype)
    return rng.integers(0, 256, size=(rows, cols // block * size), dtype=np.uint8)


def write_fixture(
    path: Path,
    *,
    kv: list[tuple[str, Any, V, V | None]] | None = None,
    tensors: dict[str, tuple[np.ndarray, Q]] | None = None,
    alignment: int | None = None,
    arch: str = "llama",
    endian: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE,
) -> Fixture:
    """Write a GGUF file with ``kv`` metadata and ``tensors`` (name -> (data, ggml type));
    block-quantized data is given as uint8 rows of blocks."""
    kv = list(kv or [])
    tensors = dict(tensors or {})
    writer = gguf.GGUFWriter(path, arch, endianess=endian)
    try:
        if alignment is not None:
            writer.add_custom_alignment(alignment)
        for key, value, vtype, sub in kv:
            writer.add_key_value(key, value, vtype, sub_type=sub)
        for name, (data, qtype) in tensors.items():
            if data.dtype == np.uint8:
                writer.add_tensor(name, data, raw_dtype=qtype)
            else:
                writer.add_tensor(name, data)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return Fixture(path, kv, tensors, alignment or 32)


def mixed_tensors(seed: int = 0) -> dict[str, tuple[np.ndarray, Q]]:
    """Tensors of several ggml types (F32, F16, Q8_0, Q4_K, Q6_K, I32), some of sizes that
    are not multiples of 32 bytes, in several layers named out of numeric order."""
    rng = np.random.default_rng(seed)
    return {
        "token_embd.weight": (quantized_bytes(rng, Q.Q8_0, 16, 64), Q.Q8_0),
        "blk.10.attn_q.weight": (quantized_bytes(rng, Q.Q4_K, 4, 256), Q.Q4_K),
        "blk.2.attn_norm.weight": (rng.standard_normal(7).astype(np.float32), Q.F32),
        "blk.2.ffn_up.weight": (rng.standard_normal((3, 5)).astype(np.float16), Q.F16),
        "blk.0.ffn_down.weight": (quantized_bytes(rng, Q.Q6_K, 2, 512), Q.Q6_K),
        "blk.1.pos.weight": (rng.integers(-5, 5, size=(2, 3), dtype=np.int32), Q.I32),
        "output_norm.weight": (rng.standard_normal(64).astype(np.float32), Q.F32),
    }


def split_gguf(src: Path, dest_prefix: Path, counts: list[int]) -> list[Path]:
    """Cut the GGUF file ``src`` into ``len(counts)`` splits of ``counts[i]`` tensors in file
    order, as llama.cpp's gguf-split does: all metadata in the first split, ``split.no``,
    ``split.count`` and ``split.tensors.count`` in every split, each split with its own
    aligned data section. Returns the paths ``PREFIX-%05d-of-%05d.gguf``."""
    import struct as _struct

    from service.io.align import align_up
    from service.loader.gguf import read_gguf

    f = read_gguf(src)
    assert sum(counts) == len(f.tensors)
    raw = src.read_bytes()
    entries = list(f.kv.values())
    kv_end = f.tensors[0].info_offset if f.tensors else f.data_offset
    kv_blob = raw[entries[0].offset : kv_end] if entries else b""

    def string(s: str) -> bytes:
        b = s.encode()
        return _struct.pack("<Q", len(b)) + b

    n = len(counts)
    paths = []
    start = 0
    for i, count in enumerate(counts):
        tensors = f.tensors[start : start + count]
        start += count
        split_kv = (
            string("split.no") + _struct.pack("<IH", V.UINT16, i)
            + string("split.count") + _struct.pack("<IH", V.UINT16, n)
            + string("split.tensors.count") + _struct.pack("<Ii", V.INT32, len(f.tensors))
        )  # fmt: skip
        n_kv = 3 + (len(entries) if i == 0 else 0)
        body = bytearray(b"GGUF" + _struct.pack("<IQQ", 3, len(tensors), n_kv))
        if i == 0:
            body += kv_blob
        body += split_kv
        rel = 0
        for t in tensors:
            body += string(t.name) + _struct.pack("<I", len(t.ne))
            body += b"".join(_struct.pack("<Q", d) for d in t.ne)
            body += _struct.pack("<IQ", t.ggml_type.id, rel)
            rel += align_up(t.nbytes, f.alignment)
        body += b"\0" * (align_up(len(body), f.alignment) - len(body))
        for t in tensors:
            at = f.data_offset + t.offset
            body += raw[at : at + t.nbytes]
            body += b"\0" * (align_up(t.nbytes, f.alignment) - t.nbytes)
        path = Path(f"{dest_prefix}-{i + 1:05d}-of-{n:05d}.gguf")
        path.write_bytes(bytes(body))
        paths.append(path)
    return paths


# -- hand-made GGUF bytes, for inputs no writer produces ------------------------------------


def gguf_string(s: str | bytes) -> bytes:
    """A GGUF string: u64 length and the bytes."""
    import struct as _struct

    b = s.encode() if isinstance(s, str) else s
    return _struct.pack("<Q", len(b)) + b


def gguf_kv(key: str | bytes, vtype: V, payload: bytes) -> bytes:
    """One KV pair: key, value type, and the already-encoded value."""
    import struct as _struct

    return gguf_string(key) + _struct.pack("<I", vtype) + payload


def gguf_tensor_info(name: str | bytes, ne: list[int], ggml_type: int, offset: int) -> bytes:
    """One tensor info (``ne`` as signed 64-bit values)."""
    import struct as _struct

    return (
        gguf_string(name)
        + _struct.pack("<I", len(ne))
        + b"".join(_struct.pack("<q", d) for d in ne)
        + _struct.pack("<iQ", ggml_type, offset)
    )


def raw_gguf(
    kvs: list[bytes], infos: list[bytes], data: bytes = b"", *, alignment: int = 32, version: int = 3
) -> bytes:
    """A whole file: header with the counts of ``kvs`` and ``infos``, padding, ``data``."""
    import struct as _struct

    head = b"GGUF" + _struct.pack("<IQQ", version, len(infos), len(kvs)) + b"".join(kvs) + b"".join(infos)
    pad = (-len(head)) % alignment if infos else 0
    return head + b"\0" * pad + data


def gguf_file(
    tensors: Sequence[tuple[str | bytes, list[int], int, bytes]],
    kvs: Sequence[bytes] | None = None,
    *,
    alignment: int = 32,
) -> bytes:
    """A whole little-endian file holding ``tensors`` (name, ne, ggml type id, data), laid
    out as ``gguf.cpp`` expects: offsets in order, each tensor's data padded to the
    alignment."""
    infos, data = [], b""
    for name, ne, type_id, payload in tensors:
        infos.append(gguf_tensor_info(name, ne, type_id, len(data)))
        data += payload + b"\0" * ((-len(payload)) % alignment)
    return raw_gguf(list(kvs or []), infos, data, alignment=alignment)


def block_model(
    path: Path,
    n_blocks: int,
    *,
    per_block: tuple[str, ...] = ("attn_q.weight", "ffn_up.weight"),
    output: bool = True,
    arch: str = "llama",
    elements: int = 32,
) -> Path:
    """A model of ``n_blocks`` repeating layers (``<arch>.block_count`` set) with small F32
    tensors: ``token_embd.weight``, ``output_norm.weight``, ``output.weight`` (unless
    ``output`` is False: a tied output) and ``blk.N.<name>`` for each of ``per_block``."""
    f32 = Q.F32
    tensors: dict[str, tuple[np.ndarray, Q]] = {
        "token_embd.weight": (np.arange(4 * elements, dtype=np.float32), f32),
        "output_norm.weight": (np.ones(elements, dtype=np.float32), f32),
    }
    if output:
        tensors["output.weight"] = (np.full(2 * elements, 2.0, dtype=np.float32), f32)
    for i in range(n_blocks):
        for name in per_block:
            tensors[f"blk.{i}.{name}"] = (np.full(elements, float(i), dtype=np.float32), f32)
    write_fixture(path, kv=[(f"{arch}.block_count", n_blocks, V.UINT32, None)], tensors=tensors, arch=arch)
    return path


# byte offsets of the f16 scale fields in one block, per block-quantized type used in tests
SCALE_FIELDS: dict[Q, tuple[int, ...]] = {Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q6_K: (208,), Q.Q5_0: (0,)}


def finite_quant(rng: np.random.Generator, qtype: Q, rows: int, cols: int) -> np.ndarray:
    """Random blocks of ``qtype`` whose scales are all 1.0 (valid for check-tensors)."""
    data = quantized_bytes(rng, qtype, rows, cols)
    _, size = type_sizes(qtype)
    blocks = data.reshape(-1, size)
    for at in SCALE_FIELDS[qtype]:
        blocks[:, at : at + 2] = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
    return data


def set_scale(data: np.ndarray, qtype: Q, block: int, value: float, field: int = 0) -> None:
    """Write ``value`` (as f16) into scale field ``field`` of block ``block`` of ``data``."""
    _, size = type_sizes(qtype)
    at = SCALE_FIELDS[qtype][field]
    flat = data.reshape(-1)
    flat[block * size + at : block * size + at + 2] = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)


def refuse_o_direct(monkeypatch: Any) -> None:
    """Make ``open(..., O_DIRECT)`` fail with EINVAL, as on a filesystem that refuses it."""
    import errno
    import os

    from service.io import direct

    real_open = os.open

    def no_direct(p: str, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(p, flags, *args)

    monkeypatch.setattr(direct.os, "open", no_direct)
