"""Write (or with --check, compare) service/loader/tensor_table.py from a llama.cpp source tree.

.venv/bin/python scripts/tensor_table.py LLAMA_CPP_DIR [--check]

What is read, for the source layout of llama.cpp 0c1e570 (any change of that layout
stops the script with the file and what was expected, rather than writing a wrong table):

- ``src/llama-arch.cpp``: ``LLM_ARCH_NAMES`` (enum -> ``general.architecture``),
  ``LLM_TENSOR_NAMES`` (tensor kind -> GGUF name template) and ``LLM_TENSOR_INFOS``
  (tensor kind -> layer class and op).
- ``src/llama-model.cpp``: ``llama_model_mapping`` (architecture -> model class) and the
  ``llama_model_base`` helpers that create tensors for a caller (``create_tensor_qkv``...).
- ``src/models/models.h``: which model class reuses another's ``load_arch_tensors``.
- ``src/models/*.cpp``: every ``load_arch_tensors`` body; the tensor kinds it names
  (and those of the helpers it calls) are the kinds of its architectures.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "service" / "loader" / "tensor_table.py"

LAYERS = {
    "LLM_TENSOR_LAYER_INPUT": "input",
    "LLM_TENSOR_LAYER_REPEATING": "repeating",
    "LLM_TENSOR_LAYER_OUTPUT": "output",
}


class LayoutError(Exception):
    """The source tree is not laid out as this script expects."""


@dataclass(frozen=True)
class Table:
    """What the generated module holds.

    Attributes:
        kinds: kind (enum name without ``LLM_TENSOR_``) -> (template, layer class, op);
            layer class and op are None for kinds without an info entry.
        archs: ``general.architecture`` -> sorted kinds its loader creates.
        tied: architectures whose loader reuses ``token_embd`` as the output weight.
        lora_experts: architectures that set a router layer, making their ``lora_a`` and
            ``lora_b`` weights inputs of ``MUL_MAT_ID``.
        suffixes: every suffix a tensor name is built with (``weight``, ``bias``...).
    """

    kinds: dict[str, tuple[str, str | None, str | None]]
    archs: dict[str, tuple[str, ...]]
    tied: tuple[str, ...]
    lora_experts: tuple[str, ...]
    suffixes: tuple[str, ...]


def _strip_comments(text: str) -> str:
    """``text`` without C++ comments; string and character literals kept intact."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(text[i : j + 1])
            i = j + 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            if j < 0:
                raise LayoutError("unterminated /* comment")
            i = j + 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _block(text: str, open_at: int, where: str) -> str:
    """The text between the brace at ``open_at`` and its matching close brace."""
    if text[open_at] != "{":
        raise LayoutError(f"{where}: expected '{{'")
    depth = 0
    i = open_at
    while i < len(text):
        c = text[i]
        if c in "\"'":
            j = i + 1
            while j < len(text) and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            i = j + 1
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i]
        i += 1
    raise LayoutError(f"{where}: unbalanced braces")


def _map_entries(text: str, header: str, entry: re.Pattern[str], where: str) -> list[tuple[str, ...]]:
    """The entries of the ``static const std::map<...> NAME = { ... };`` initializer."""
    start = text.find(header)
    if start < 0:
        raise LayoutError(f"{where}: '{header}' not found")
    body = _block(text, text.index("{", start + len(header) - 1), where)
    entries = []
    for line in body.splitlines():
        line = line.strip()
        if not line:
            continue
        m = entry.fullmatch(line)
        if m is None:
            raise LayoutError(f"{where}: unexpected line in {header!r}: {line!r}")
        entries.append(m.groups())
    if not entries:
        raise LayoutError(f"{where}: {header!r} is empty")
    return entries


def _unique(entries: list[tuple[str, ...]], where: str) -> dict[str, tuple[str, ...]]:
    """Entries by key; a repeated key must repeat the same value (a map keeps one)."""
    out: dict[str, tuple[str, ...]] = {}
    for key, *value in entries:
        if key in out and out[key] != tuple(value):
            raise LayoutError(f"{where}: {key} has two different values")
        out.setdefault(key, tuple(value))
    return out


def _functions(text: str, pattern: re.Pattern[str], where: str) -> dict[str, str]:
    """Bodies of the function definitions whose head ``pattern`` matches (group 1 names them)."""
    out = {}
    for m in pattern.finditer(text):
        open_at = text.index("{", m.end())
        between = text[m.end() : open_at]
        if ";" in between:
            continue  # a declaration
        out[m.group(1)] = _block(text, open_at, f"{where}: {m.group(1)}")
    return out


KIND_TOKEN = re.compile(r"\bLLM_TENSOR_([A-Z0-9_]+)\b")
TN_SUFFIX = re.compile(r"\btn\(\s*[A-Za-z_][A-Za-z0-9_]*\s*,\s*\"([^\"]*)\"")


def parse(src: Path) -> Table:
    """Read the tables out of the llama.cpp tree ``src``.

    Raises:
        LayoutError: a file is missing or not shaped as expected.
    """
    try:
        arch_cpp = _strip_comments((src / "src" / "llama-arch.cpp").read_text())
        model_cpp = _strip_comments((src / "src" / "llama-model.cpp").read_text())
        models_h = _strip_comments((src / "src" / "models" / "models.h").read_text())
        model_files = {p.name: _strip_comments(p.read_text()) for p in sorted((src / "src" / "models").glob("*.cpp"))}
    except OSError as e:
        raise LayoutError(str(e)) from e

    arch_names = _unique(
        _map_entries(
            arch_cpp,
            "static const std::map<llm_arch, const char *> LLM_ARCH_NAMES = {",
            re.compile(r'\{\s*(LLM_ARCH_[A-Z0-9_]+)\s*,\s*"([^"]+)"\s*\},'),
            "llama-arch.cpp",
        ),
        "LLM_ARCH_NAMES",
    )
    names = _unique(
        _map_entries(
            arch_cpp,
            "static const std::map<llm_tensor, const char *> LLM_TENSOR_NAMES = {",
            re.compile(r'\{\s*LLM_TENSOR_([A-Z0-9_]+)\s*,\s*"([^"]+)"\s*\},'),
            "llama-arch.cpp",
        ),
        "LLM_TENSOR_NAMES",
    )
    infos = _unique(
        _map_entries(
            arch_cpp,
            "static const std::map<llm_tensor, llm_tensor_info> LLM_TENSOR_INFOS = {",
            re.compile(
                r"\{\s*LLM_TENSOR_([A-Z0-9_]+)\s*,\s*\{\s*(LLM_TENSOR_LAYER_[A-Z]+)\s*,\s*GGML_OP_([A-Z0-9_]+)\s*\}\s*\},"
            ),
            "llama-arch.cpp",
        ),
        "LLM_TENSOR_INFOS",
    )
    for kind, (layer, _) in infos.items():
        if kind not in names:
            raise LayoutError(f"LLM_TENSOR_INFOS: {kind} has no name")
        if layer not in LAYERS:
            raise LayoutError(f"LLM_TENSOR_INFOS: {kind}: unknown layer {layer}")
    for kind, (template,) in names.items():
        if template.count("%d") > 2 or re.search(r"%(?!d)", template):
            raise LayoutError(f"LLM_TENSOR_NAMES: {kind}: unexpected template {template!r}")
    kinds: dict[str, tuple[str, str | None, str | None]] = {}
    for kind, (template,) in sorted(names.items()):
        info = infos.get(kind)
        kinds[kind] = (template, LAYERS[info[0]], info[1]) if info else (template, None, None)

    # architecture -> model class
    mapping = _functions(model_cpp, re.compile(r"\bllama_model \* (llama_model_mapping)\("), "llama-model.cpp")
    if "llama_model_mapping" not in mapping:
        raise LayoutError("llama-model.cpp: llama_model_mapping not found")
    arch_class: dict[str, str] = {}
    pending: list[str] = []
    for line in mapping["llama_model_mapping"].splitlines():
        line = line.strip()
        if not line or line in ("switch (arch) {", "}", "default:") or line.startswith("throw "):
            continue
        if m := re.fullmatch(r"case (LLM_ARCH_[A-Z0-9_]+):", line):
            pending.append(m.group(1))
        elif m := re.fullmatch(r"return new llama_model_([a-z0-9_]+)\(params\);", line):
            if not pending:
                raise LayoutError(f"llama_model_mapping: '{line}' without a case")
            for enum in pending:
                arch_class[enum] = m.group(1)
            pending = []
        else:
            raise LayoutError(f"llama_model_mapping: unexpected line {line!r}")
    if not arch_class:
        raise LayoutError("llama_model_mapping: no cases")

    bases = dict(re.findall(r"\bstruct llama_model_([a-z0-9_]+)\s*:\s*public\s+llama_model_([a-z0-9_]+)\b", models_h))
    bodies: dict[str, str] = {}
    hparams: dict[str, str] = {}
    for fname, text in model_files.items():
        for found, what in ((bodies, "load_arch_tensors"), (hparams, "load_arch_hparams")):
            head = re.compile(rf"\bvoid llama_model_([a-z0-9_]+)::{what}\(")
            for cls, body in _functions(text, head, fname).items():
                if cls in found:
                    raise LayoutError(f"{fname}: a second {what} for {cls}")
                found[cls] = body
    helpers = {
        fn: set(KIND_TOKEN.findall(body))
        for fn, body in _functions(
            model_cpp, re.compile(r"\b[a-z_*& ]+ llama_model_base::([a-z0-9_]+)\("), "llama-model.cpp"
        ).items()
        if fn not in ("load_tensors", "create_tensor") and KIND_TOKEN.search(body)
    }

    archs: dict[str, tuple[str, ...]] = {}
    tied: list[str] = []
    lora_experts: list[str] = []
    suffixes: set[str] = set()
    for enum, cls in sorted(arch_class.items()):
        if enum not in arch_names:
            raise LayoutError(f"llama_model_mapping: {enum} has no name in LLM_ARCH_NAMES")
        owner = _owner(cls, bodies, bases)
        if owner is None:
            raise LayoutError(f"no load_arch_tensors for llama_model_{cls} ({enum})")
        body = bodies[owner]
        hparams_owner = _owner(cls, hparams, bases)
        if hparams_owner is not None and re.search(r"\brouter_layer\s*=[^=]", hparams[hparams_owner]):
            lora_experts.append(arch_names[enum][0])
        used = set(KIND_TOKEN.findall(body))
        for fn, fn_kinds in helpers.items():
            if re.search(rf"\b{fn}\(", body):
                used |= fn_kinds
        used = {k for k in used if not k.startswith("LAYER_")}
        unknown = used - names.keys()
        if unknown:
            raise LayoutError(f"llama_model_{owner}::load_arch_tensors names unknown kinds {sorted(unknown)}")
        archs[arch_names[enum][0]] = tuple(sorted(used))
        statements = body.split(";")
        if any("LLM_TENSOR_TOKEN_EMBD," in s and "TENSOR_DUPLICATED" in s for s in statements):
            tied.append(arch_names[enum][0])
    for text in (model_cpp, *model_files.values()):
        suffixes.update(TN_SUFFIX.findall(text))
    if not suffixes or any(not re.fullmatch(r"[a-z_]+", s) for s in suffixes):
        raise LayoutError(f"unexpected tensor name suffixes {sorted(suffixes)}")
    table = Table(
        kinds, dict(sorted(archs.items())), tuple(sorted(tied)), tuple(sorted(lora_experts)), tuple(sorted(suffixes))
    )
    _check_unambiguous(table)
    return table


def _owner(cls: str, defined: dict[str, str], bases: dict[str, str]) -> str | None:
    """The class whose definition ``cls`` uses: itself or the nearest base defining it."""
    while cls not in defined and cls in bases:
        cls = bases[cls]
    return cls if cls in defined else None


def _check_unambiguous(table: Table) -> None:
    """Within an architecture, one tensor name must mean one kind: no two kinds share a
    template, and no template followed by a suffix spells another template."""
    for arch, kinds in table.archs.items():
        seen: dict[str, str] = {}
        for kind in kinds:
            template = table.kinds[kind][0]
            for spelled in (template, *(f"{template}.{s}" for s in table.suffixes)):
                other = seen.setdefault(spelled, kind)
                if other != kind and table.kinds[other][1:] != table.kinds[kind][1:]:
                    raise LayoutError(f"{arch}: {spelled!r} is both {other} and {kind}")


def _str(s: str | None) -> str:
    return "None" if s is None else f'"{s}"'


def _frozenset(name: str, comment: str, items: tuple[str, ...]) -> list[str]:
    if not items:
        return ["", f"# {comment}", f"{name}: frozenset[str] = frozenset()"]
    return [
        "",
        f"# {comment}",
        f"{name}: frozenset[str] = frozenset(",
        "    {",
        *(f'        "{a}",' for a in items),
        "    }",
        ")",
    ]


def render(table: Table) -> str:
    """The Python module for ``table`` (already as ``ruff format`` writes it)."""
    out = [
        '"""llama.cpp\'s tensor table: the GGUF name template, layer class and op of every tensor',
        "kind, and the kinds each architecture's loader creates.",
        "",
        "Generated by scripts/tensor_table.py from llama.cpp's src/llama-arch.cpp, src/llama-model.cpp",
        "and src/models/; do not edit. Read through service.loader.tensor_classes.",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "# kind -> (name template, layer class, op); layer class and op are None where llama.cpp",
        "# has no info for the kind (it refuses to create such a tensor)",
        "KINDS: dict[str, tuple[str, str | None, str | None]] = {",
    ]
    for kind, (template, layer, op) in table.kinds.items():
        out.append(f'    "{kind}": ("{template}", {_str(layer)}, {_str(op)}),')
    out += ["}", "", "# general.architecture -> the kinds its loader creates"]
    out.append("ARCHITECTURES: dict[str, tuple[str, ...]] = {")
    for arch, kinds in table.archs.items():
        if not kinds:
            out.append(f'    "{arch}": (),')
            continue
        out.append(f'    "{arch}": (')
        out += [f'        "{k}",' for k in kinds]
        out.append("    ),")
    out.append("}")
    out += _frozenset(
        "TIED_OUTPUT",
        "architectures whose loader reuses token_embd as the output weight when there is no output",
        table.tied,
    )
    out += _frozenset(
        "LORA_EXPERTS",
        "architectures whose lora_a / lora_b weights feed MUL_MAT_ID (they set a router layer)",
        table.lora_experts,
    )
    out += ["", "# the suffixes tensor names are built with: <template>.<suffix>", "SUFFIXES: tuple[str, ...] = ("]
    out += [f'    "{s}",' for s in table.suffixes]
    out += [")", ""]
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="a llama.cpp source tree")
    parser.add_argument("--check", action="store_true", help="exit 1 when the checked-in table is not current")
    parser.add_argument("--output", type=Path, default=OUTPUT, help="the module to write or check")
    args = parser.parse_args()
    try:
        text = render(parse(args.source))
    except LayoutError as e:
        sys.stderr.write(f"{args.source}: {e}\n")
        return 2
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            sys.stderr.write(f"{args.output}: out of date with {args.source}; run scripts/tensor_table.py\n")
            return 1
        return 0
    args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
