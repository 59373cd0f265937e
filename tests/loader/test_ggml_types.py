"""hoist's ggml type table agrees with ggml: with the llama.cpp sources when they are at
hand (the generator, and a C compiler's sizeof/offsetof of ggml's block structs), and
without them with the block layouts written out below and known invariants."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import gguf
import numpy as np
import pytest

from service.loader import ggml_type_table, validate
from service.loader.ggml_types import (
    ALL_GGML_TYPES,
    GGML_TYPE_COUNT,
    GGML_TYPES,
    GGML_TYPES_BY_NAME,
    REMOVED_GGML_TYPES,
    numpy_dtype,
)
from tests.llama_src import ROOT, require_llama_cpp

# ggml's block structs (ggml/src/ggml-common.h at llama.cpp 0c1e570), written out by hand:
# elements per block and the struct's fields in order as (name, bytes). Fields of the
# anonymous d/m unions are listed as the two halves.
BLOCK_LAYOUTS: dict[str, tuple[int, list[tuple[str, int]]]] = {
    "Q1_0": (128, [("d", 2), ("qs", 16)]),
    "Q2_0": (64, [("d", 2), ("qs", 16)]),
    "Q4_0": (32, [("d", 2), ("qs", 16)]),
    "Q4_1": (32, [("d", 2), ("m", 2), ("qs", 16)]),
    "MXFP4": (32, [("e", 1), ("qs", 16)]),
    "NVFP4": (64, [("d", 4), ("qs", 32)]),
    "Q5_0": (32, [("d", 2), ("qh", 4), ("qs", 16)]),
    "Q5_1": (32, [("d", 2), ("m", 2), ("qh", 4), ("qs", 16)]),
    "Q8_0": (32, [("d", 2), ("qs", 32)]),
    "Q8_1": (32, [("d", 2), ("s", 2), ("qs", 32)]),
    "TQ1_0": (256, [("qs", 48), ("qh", 4), ("d", 2)]),
    "TQ2_0": (256, [("qs", 64), ("d", 2)]),
    "Q2_K": (256, [("scales", 16), ("qs", 64), ("d", 2), ("dmin", 2)]),
    "Q3_K": (256, [("hmask", 32), ("qs", 64), ("scales", 12), ("d", 2)]),
    "Q4_K": (256, [("d", 2), ("dmin", 2), ("scales", 12), ("qs", 128)]),
    "Q5_K": (256, [("d", 2), ("dmin", 2), ("scales", 12), ("qh", 32), ("qs", 128)]),
    "Q6_K": (256, [("ql", 128), ("qh", 64), ("scales", 16), ("d", 2)]),
    "Q8_K": (256, [("d", 4), ("qs", 256), ("bsums", 32)]),
    "IQ2_XXS": (256, [("d", 2), ("qs", 64)]),
    "IQ2_XS": (256, [("d", 2), ("qs", 64), ("scales", 8)]),
    "IQ2_S": (256, [("d", 2), ("qs", 64), ("qh", 8), ("scales", 8)]),
    "IQ3_XXS": (256, [("d", 2), ("qs", 96)]),
    "IQ3_S": (256, [("d", 2), ("qs", 64), ("qh", 8), ("signs", 32), ("scales", 4)]),
    "IQ1_S": (256, [("d", 2), ("qs", 32), ("qh", 16)]),
    "IQ1_M": (256, [("qs", 32), ("qh", 16), ("scales", 8)]),
    "IQ4_NL": (32, [("d", 2), ("qs", 16)]),
    "IQ4_XS": (256, [("d", 2), ("scales_h", 2), ("scales_l", 4), ("qs", 128)]),
}
# plain types: one element per block, the size of the matching numpy type
PLAIN_TYPES = {"F32": "f4", "F16": "f2", "BF16": "u2", "F64": "f8", "I8": "i1", "I16": "i2", "I32": "i4", "I64": "i8"}
# ids ggml keeps reserved for types whose support it removed (commented out in its enum)
REMOVED = {4: "Q4_2", 5: "Q4_3", 31: "Q4_0_4_4", 32: "Q4_0_4_8", 33: "Q4_0_8_8"} | {
    36: "IQ4_NL_4_4",
    37: "IQ4_NL_4_8",
    38: "IQ4_NL_8_8",
}
# where gguf-py 0.19's table lags ggml's: (gguf-py's type size, ggml's)
GGUF_PY_LAGS = {"Q8_1": (40, 36)}


def _offsets(fields: list[tuple[str, int]]) -> dict[str, int]:
    at, out = 0, {}
    for name, nbytes in fields:
        out[name] = at
        at += nbytes
    return out


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ggml_types_script", ROOT / "scripts" / "ggml_types.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


# -- without the llama.cpp sources ------------------------------------------------------


def test_ids_cover_the_enum_once() -> None:
    assert sorted(ALL_GGML_TYPES) == list(range(GGML_TYPE_COUNT))
    assert len({t.name for t in ALL_GGML_TYPES.values()}) == GGML_TYPE_COUNT
    assert {i: t.name for i, t in REMOVED_GGML_TYPES.items()} == REMOVED
    assert set(GGML_TYPES) | set(REMOVED_GGML_TYPES) == set(ALL_GGML_TYPES)
    assert not set(GGML_TYPES) & set(REMOVED_GGML_TYPES)


def test_every_type_matches_its_block_layout() -> None:
    assert set(GGML_TYPES_BY_NAME) == set(BLOCK_LAYOUTS) | set(PLAIN_TYPES)
    for name, (block, fields) in BLOCK_LAYOUTS.items():
        t = GGML_TYPES_BY_NAME[name]
        assert (t.block_size, t.type_size) == (block, sum(n for _, n in fields)), name
        assert t.quantized and t.type_name.upper() == name, name
    for name, code in PLAIN_TYPES.items():
        t = GGML_TYPES_BY_NAME[name]
        assert (t.block_size, t.type_size) == (1, np.dtype(code).itemsize), name
        assert not t.quantized and t.type_name == name.lower()
        assert numpy_dtype(t).itemsize == t.type_size
    for t in REMOVED_GGML_TYPES.values():
        assert (t.block_size, t.type_size, t.quantized, t.type_name) == (0, 0, False, "")


def test_validation_reads_the_scales_where_the_structs_have_them() -> None:
    for name, scales in validate._BLOCK_SCALES.items():
        offsets = _offsets(BLOCK_LAYOUTS[name][1])
        for scale in scales:
            assert scale.offset == offsets[scale.name], (name, scale.name)


def test_agrees_with_gguf_py_except_where_gguf_py_lags() -> None:
    ours = {t.name: (t.block_size, t.type_size) for t in GGML_TYPES.values()}
    theirs = {t.name: size for t, size in gguf.GGML_QUANT_SIZES.items()}
    for name, (block, size) in theirs.items():
        if name in GGUF_PY_LAGS and size == GGUF_PY_LAGS[name][0]:
            assert ours[name] == (block, GGUF_PY_LAGS[name][1])
        else:
            assert ours[name] == (block, size), name
    assert set(theirs) <= set(ours)


def _write_tree(root: Path, *, traits_q: str = ".blck_size = QK4_0, .type_size = sizeof(block_q4_0)") -> Path:
    (root / "ggml" / "include").mkdir(parents=True)
    (root / "ggml" / "src").mkdir(parents=True)
    (root / "ggml" / "include" / "ggml.h").write_text(
        "enum ggml_type {\n    GGML_TYPE_F32 = 0,\n    // GGML_TYPE_OLD = 1, gone\n"
        "    GGML_TYPE_Q4_0 = 2,\n    GGML_TYPE_COUNT = 3,\n};\n"
    )
    (root / "ggml" / "src" / "ggml-common.h").write_text(
        "#define QK4_0 32 // elements\ntypedef struct { ggml_half d; uint8_t qs[QK4_0 / 2]; } block_q4_0;\n"
        'static_assert(sizeof(block_q4_0) == sizeof(ggml_half) + QK4_0 / 2, "size");\n'
    )
    (root / "ggml" / "src" / "ggml.c").write_text(
        "static const struct ggml_type_traits type_traits[GGML_TYPE_COUNT] = {\n"
        '    [GGML_TYPE_F32] = {\n        .type_name = "f32",\n        .blck_size = 1,\n'
        "        .type_size = sizeof(float),\n        .is_quantized = false,\n    },\n"
        '    [1] = { // GGML_TYPE_OLD\n        .type_name = "OLD, gone",\n        .blck_size = 0,\n'
        "        .type_size = 0,\n        .is_quantized = false,\n    },\n"
        f'    [GGML_TYPE_Q4_0] = {{\n        .type_name = "q4_0",\n        {traits_q},\n'
        "        .is_quantized = true,\n    },\n};\n"
    )
    return root


def test_generator_reads_a_small_tree(tmp_path: Path) -> None:
    script = _script()
    count, rows = script.read_table(_write_tree(tmp_path / "a"))
    assert count == 3
    assert [(r.id, r.name, r.type_name, r.block_size, r.type_size, r.quantized, r.removed) for r in rows] == [
        (0, "F32", "f32", 1, 4, False, False),
        (1, "OLD", "", 0, 0, False, True),
        (2, "Q4_0", "q4_0", 32, 18, True, False),
    ]
    namespace: dict[str, object] = {}
    exec(script.render(count, rows), namespace)  # the rendered module is valid Python with the same rows
    assert namespace["GGML_TYPE_COUNT"] == 3 and len(namespace["GGML_TYPE_ROWS"]) == 3  # type: ignore[arg-type]


def test_generator_refuses_a_tree_it_cannot_read(tmp_path: Path) -> None:
    script = _script()
    with pytest.raises(script.SourceError, match="unknown size of 'block_q9'"):
        script.read_table(_write_tree(tmp_path / "a", traits_q=".blck_size = 32, .type_size = sizeof(block_q9)"))
    with pytest.raises(script.SourceError, match="unknown macro 'QK9'"):
        script.read_table(_write_tree(tmp_path / "b", traits_q=".blck_size = QK9, .type_size = 18"))
    with pytest.raises(script.SourceError, match="disagree on whether it was removed"):
        script.read_table(_write_tree(tmp_path / "c", traits_q=".blck_size = 0, .type_size = 0"))
    with pytest.raises(OSError):
        script.read_table(tmp_path / "missing")


# -- with the llama.cpp sources -----------------------------------------------------------


def test_table_is_what_the_generator_reads_from_llama_cpp() -> None:
    llama = require_llama_cpp()
    script = _script()
    count, rows = script.read_table(llama)
    assert script.render(count, rows) == Path(ggml_type_table.__file__).read_text(), "run scripts/ggml_types.py"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "ggml_types.py"), str(llama), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_a_moved_llama_cpp_fails_the_check(tmp_path: Path) -> None:
    llama = require_llama_cpp()
    for rel in ("ggml/include/ggml.h", "ggml/src/ggml.c", "ggml/src/ggml-common.h"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(llama / rel, tmp_path / rel)
    common = tmp_path / "ggml/src/ggml-common.h"
    text = common.read_text()
    assert "2*sizeof(ggml_half) + QK8_1," in text
    common.write_text(text.replace("2*sizeof(ggml_half) + QK8_1,", "2*sizeof(ggml_half) + QK8_1 + 4,"))
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "ggml_types.py"), str(tmp_path), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 1 and "differs" in result.stderr


def test_block_layouts_are_what_a_c_compiler_makes_of_ggml_common_h(tmp_path: Path) -> None:
    """sizeof and offsetof of every block struct, compiled from ggml-common.h: checks the
    hand-written layouts above (and through them the table and validation offsets)."""
    llama = require_llama_cpp()
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc) to compile ggml-common.h with")
    lines = ["#define GGML_COMMON_DECL_C", '#include "ggml-common.h"', "#include <stddef.h>", "#include <stdio.h>"]
    lines.append("int main(void) {")
    for name, (_, fields) in BLOCK_LAYOUTS.items():
        struct = f"block_{GGML_TYPES_BY_NAME[name].type_name}"
        lines.append(f'    printf("{name} size %zu\\n", sizeof({struct}));')
        for field, _ in fields:
            lines.append(f'    printf("{name} {field} %zu\\n", offsetof({struct}, {field}));')
    lines += ["    return 0;", "}"]
    source = tmp_path / "layouts.c"
    source.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "layouts"
    subprocess.run(
        [cc, "-std=c11", "-I", str(llama / "ggml" / "src"), str(source), "-o", str(exe)], check=True, timeout=120
    )
    printed = subprocess.run([str(exe)], capture_output=True, text=True, check=True, timeout=30).stdout
    got = {tuple(line.split()[:2]): int(line.split()[2]) for line in printed.splitlines()}
    for name, (_, fields) in BLOCK_LAYOUTS.items():
        assert got[(name, "size")] == sum(n for _, n in fields) == GGML_TYPES_BY_NAME[name].type_size, name
        for field, offset in _offsets(fields).items():
            assert got[(name, field)] == offset, (name, field)
