"""Write (or with --check, compare) hoist's ggml type table from a llama.cpp source tree.

.venv/bin/python scripts/ggml_types.py LLAMA_CPP_DIR [--check]

The table (``service/loader/ggml_type_table.py``) lists every id of ggml's ``enum
ggml_type`` with the facts hoist needs: the enum name, ggml's short type name, elements
per block, bytes per block, whether ggml counts it as quantized, and whether support for
it was removed. It is read from three files of the tree:

* ``ggml/include/ggml.h``: the enum (ids and names; removed ids stay as comments) and
  ``GGML_TYPE_COUNT``;
* ``ggml/src/ggml.c``: the ``type_traits`` array (type name, block size, type size as a
  ``sizeof`` expression, quantized flag; a removed id has block size 0);
* ``ggml/src/ggml-common.h``: the integer macros (``QK4_0``, ``QK_K``, ...) and, for each
  block struct, the size its ``static_assert`` states, so that ``sizeof(block_q4_0)`` is
  known without a C compiler.

Run it when the vendored llama.cpp moves, and commit the result.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "service" / "loader" / "ggml_type_table.py"

HEADER_H = Path("ggml/include/ggml.h")
TRAITS_C = Path("ggml/src/ggml.c")
COMMON_H = Path("ggml/src/ggml-common.h")

# sizes of the scalar C types that appear in sizeof() of type_traits and static_asserts
_C_SIZES = {
    "int8_t": 1,
    "uint8_t": 1,
    "int16_t": 2,
    "uint16_t": 2,
    "int32_t": 4,
    "uint32_t": 4,
    "int64_t": 8,
    "uint64_t": 8,
    "float": 4,
    "double": 8,
    "ggml_half": 2,
    "ggml_half2": 4,
    "ggml_fp16_t": 2,
    "ggml_bf16_t": 2,
}


class SourceError(Exception):
    """The llama.cpp tree does not have the shape this script reads."""


@dataclass(frozen=True)
class Row:
    """One id of ``enum ggml_type``."""

    id: int
    name: str
    type_name: str
    block_size: int
    type_size: int
    quantized: bool
    removed: bool


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _evaluate(expr: str, macros: dict[str, str], sizes: dict[str, int], depth: int = 0) -> int:
    """The value of an integer C expression of literals, macros, ``sizeof(T)`` and
    ``+ - * /`` (C integer division of non-negative values)."""
    if depth > 32:
        raise SourceError(f"macro expansion too deep in {expr!r}")

    def size_of(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in sizes:
            raise SourceError(f"unknown size of {name!r} in {expr!r}")
        return str(sizes[name])

    text = re.sub(r"\bsizeof\s*\(\s*(\w+)\s*\)", size_of, expr.strip())
    tree = ast.parse(text, mode="eval")

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in macros:
                raise SourceError(f"unknown macro {node.id!r} in {expr!r}")
            return _evaluate(macros[node.id], macros, sizes, depth + 1)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.BinOp):
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Add):
                return left + right
            if isinstance(node.op, ast.Sub):
                return left - right
            if isinstance(node.op, ast.Mult):
                return left * right
            if isinstance(node.op, ast.Div) and right > 0 and left >= 0:
                return left // right
        raise SourceError(f"cannot evaluate {ast.dump(node)} in {expr!r}")

    return walk(tree)


def read_macros(common: str) -> dict[str, str]:
    """Object-like ``#define NAME VALUE`` macros of ``ggml-common.h`` (first definition)."""
    macros: dict[str, str] = {}
    for m in re.finditer(r"^\s*#\s*define\s+(\w+)[ \t]+([^\n]+)$", _strip_comments(common), flags=re.M):
        macros.setdefault(m.group(1), m.group(2).strip())
    return macros


def read_block_sizes(common: str, macros: dict[str, str]) -> dict[str, int]:
    """``sizeof`` of each ``block_*`` struct, from the ``static_assert`` that states it."""
    sizes: dict[str, int] = {}
    pattern = r"static_assert\s*\(\s*sizeof\s*\(\s*(block_\w+)\s*\)\s*==\s*(.+?)\s*,\s*\""
    for m in re.finditer(pattern, _strip_comments(common), flags=re.S):
        sizes[m.group(1)] = _evaluate(m.group(2), macros, _C_SIZES)
    if not sizes:
        raise SourceError(f"{COMMON_H}: no static_assert on a block size found")
    return sizes


def read_enum(header: str) -> tuple[dict[int, str], set[int], int]:
    """Names by id of ``enum ggml_type`` (removed ids from their comments), the removed
    ids, and ``GGML_TYPE_COUNT``."""
    m = re.search(r"enum\s+ggml_type\s*\{(.*?)\};", header, flags=re.S)
    if m is None:
        raise SourceError(f"{HEADER_H}: enum ggml_type not found")
    names: dict[int, str] = {}
    removed: set[int] = set()
    count = None
    for line in m.group(1).splitlines():
        entry = re.match(r"\s*(//)?\s*GGML_TYPE_(\w+)\s*=\s*(\d+)\s*,", line)
        if entry is None:
            continue
        name, value = entry.group(2), int(entry.group(3))
        if name == "COUNT":
            count = value
            continue
        if value in names:
            raise SourceError(f"{HEADER_H}: ggml type id {value} appears twice")
        names[value] = name
        if entry.group(1):
            removed.add(value)
    if count is None:
        raise SourceError(f"{HEADER_H}: GGML_TYPE_COUNT not found")
    return names, removed, count


def read_traits(source: str, ids: dict[str, int], macros: dict[str, str], sizes: dict[str, int]) -> dict[int, Row]:
    """The rows of ggml.c's ``type_traits`` array by id (names filled in later)."""
    m = re.search(r"type_traits\s*\[\s*GGML_TYPE_COUNT\s*\]\s*=\s*\{(.*?)\n\};", source, flags=re.S)
    if m is None:
        raise SourceError(f"{TRAITS_C}: the type_traits array was not found")
    rows: dict[int, Row] = {}
    all_sizes = {**_C_SIZES, **sizes}
    for entry in re.finditer(r"\[\s*(\w+)\s*\]\s*=\s*\{([^{}]*)\}", m.group(1)):
        index, body = entry.group(1), entry.group(2)
        if index.isdigit():
            type_id = int(index)
        elif index.startswith("GGML_TYPE_") and index[len("GGML_TYPE_") :] in ids:
            type_id = ids[index[len("GGML_TYPE_") :]]
        else:
            raise SourceError(f"{TRAITS_C}: type_traits entry [{index}] is not a ggml type")
        fields = dict(re.findall(r'\.(\w+)\s*=\s*("(?:[^"\\]|\\.)*"|[^,\n]+?)\s*,', _strip_comments(body)))
        try:
            type_name = ast.literal_eval(fields["type_name"])
            block = _evaluate(fields["blck_size"], macros, all_sizes)
            size = _evaluate(fields["type_size"], macros, all_sizes)
            quantized = {"true": True, "false": False}[fields["is_quantized"]]
        except (KeyError, ValueError, SyntaxError) as exc:
            raise SourceError(f"{TRAITS_C}: cannot read type_traits entry [{index}]: {exc!r}") from exc
        if type_id in rows:
            raise SourceError(f"{TRAITS_C}: type_traits entry [{index}] appears twice")
        rows[type_id] = Row(type_id, "", type_name, block, size, quantized, block == 0)
    return rows


def read_table(llama_dir: Path) -> tuple[int, list[Row]]:
    """``GGML_TYPE_COUNT`` and one row per id in ``[0, GGML_TYPE_COUNT)``, read from the
    llama.cpp tree at ``llama_dir``.

    Raises:
        SourceError: a file is missing or does not have the expected shape, or the enum,
            the traits and the block structs disagree.
        OSError: a file cannot be read.
    """
    header = (llama_dir / HEADER_H).read_text()
    source = (llama_dir / TRAITS_C).read_text()
    common = (llama_dir / COMMON_H).read_text()
    names, removed, count = read_enum(header)
    macros = read_macros(common)
    sizes = read_block_sizes(common, macros)
    traits = read_traits(source, {n: i for i, n in names.items()}, macros, sizes)
    rows = []
    for type_id in range(count):
        if type_id not in names:
            raise SourceError(f"{HEADER_H}: ggml type id {type_id} is neither in the enum nor in a comment")
        row = traits.get(type_id)
        if row is None:
            raise SourceError(f"{TRAITS_C}: no type_traits entry for ggml type {names[type_id]} ({type_id})")
        if row.removed != (type_id in removed):
            raise SourceError(
                f"ggml type {names[type_id]} ({type_id}): the enum and type_traits disagree on whether it was removed"
            )
        rows.append(Row(type_id, names[type_id], "" if row.removed else row.type_name, *_sizes_of(row)))
    extra = set(traits) - set(range(count))
    if extra:
        raise SourceError(f"{TRAITS_C}: type_traits entries beyond GGML_TYPE_COUNT: {sorted(extra)}")
    return count, rows


def _sizes_of(row: Row) -> tuple[int, int, bool, bool]:
    return row.block_size, row.type_size, row.quantized, row.removed


def render(count: int, rows: list[Row]) -> str:
    """The table module's source text."""
    lines = [
        '"""ggml\'s type table: every id of ``enum ggml_type``.',
        "",
        "Generated by ``scripts/ggml_types.py`` from a llama.cpp source tree (``ggml.h``'s enum,",
        "``ggml.c``'s type traits, ``ggml-common.h``'s block structs); do not edit by hand.",
        '"""',
        "",
        f"GGML_TYPE_COUNT = {count}",
        '"""``GGML_TYPE_COUNT``: ids are ``0 <= id < GGML_TYPE_COUNT``."""',
        "",
        "GGML_TYPE_ROWS: tuple[tuple[int, str, str, int, int, bool, bool], ...] = (",
        "    # id, name, ggml type name, block size (elements), type size (bytes), quantized, removed",
    ]
    for r in rows:
        lines.append(
            f"    ({r.id}, {json.dumps(r.name)}, {json.dumps(r.type_name)}, {r.block_size}, {r.type_size},"
            f" {r.quantized}, {r.removed}),"
        )
    lines.append(")")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("llama_dir", type=Path, help="the root of a llama.cpp source tree (holding ggml/)")
    parser.add_argument("--check", action="store_true", help="exit 1 when the checked-in table differs")
    args = parser.parse_args()
    try:
        count, rows = read_table(args.llama_dir)
    except (SourceError, OSError) as exc:
        sys.stderr.write(f"{args.llama_dir}: {exc}\n")
        return 2
    text = render(count, rows)
    if args.check:
        if TABLE.read_text() != text:
            sys.stderr.write(f"{TABLE.relative_to(ROOT)} differs from {args.llama_dir}; run scripts/ggml_types.py\n")
            return 1
        return 0
    TABLE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
