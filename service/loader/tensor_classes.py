"""What each weight is: its layer class (input, output or repeating layer N) and the op that
consumes it, decided like llama.cpp: by the file's ``general.architecture`` and llama.cpp's
tensor table (service/loader/tensor_table.py, generated from llama.cpp's ``LLM_TENSOR_NAMES``,
``LLM_TENSOR_INFOS`` and each architecture's ``load_arch_tensors``).

The layer class decides which buffer type list a tensor is placed with; the op decides
whether a device can hold it (``weight_buft_supported``).

How a name is decided:

- Known architecture, name in its table: the kind's layer class and op, as llama.cpp's
  ``create_tensor`` takes them: a ``bias`` weight feeds ``ADD`` (``ADD_ID`` for an expert
  tensor), and on an architecture with a router layer a ``lora_a`` / ``lora_b`` weight feeds
  ``MUL_MAT_ID``. A repeating weight belongs to the layer of the first number in its name
  (``blk.N``, ``enc.blk.N``, ``dec.blk.N``, ``posnet.N``, ``convnext.N``), the layer index
  llama.cpp picks the buffer type list with; a repeating weight without a number
  (``rope_freqs``, ``token_embd_norm``, ``per_layer_model_proj``...) belongs to layer 0.
  Kinds whose op is ``NONE`` are unused: llama.cpp ignores them (``model has unused
  tensor``), and so does the plan.
- Known architecture, name not in its table: llama.cpp never creates such a tensor and
  refuses the file (``wrong number of tensors``). hoist still places it, by the rules for
  an unknown architecture below, and the plan says so in a warning.
- Unknown architecture (or none): llama.cpp refuses the file (``unknown model
  architecture``). hoist classifies by name: a name any architecture's table spells takes
  that kind (where two kinds spell the same name, the one more architectures use); other
  names follow name rules (``blk.N.*``: repeating, ``*_exps`` -> ``MUL_MAT_ID``, norms ->
  ``MUL``, the rest ``MUL_MAT``; other names: input, ``GET_ROWS``, kept on the CPU). The
  plan warns that llama.cpp would not load the file.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cache, lru_cache
from typing import Literal, NamedTuple

from service.loader.tensor_table import ARCHITECTURES, KINDS, LORA_EXPERTS, SUFFIXES, TIED_OUTPUT


class LayerClass(StrEnum):
    """llama.cpp's ``llm_tensor_layer``."""

    INPUT = "input"
    OUTPUT = "output"
    REPEATING = "repeating"


UNUSED_OP = "NONE"
"""The op of a kind llama.cpp loads but never uses; such tensors are ignored."""

Source = Literal["architecture", "table", "names"]


class TensorClass(NamedTuple):
    """How a weight is used (a named tuple: a plan makes one per weight).

    Attributes:
        layer_class: input, output or repeating.
        op: the ggml op that consumes the weight (``MUL_MAT``, ``GET_ROWS``, ...;
            :data:`UNUSED_OP` for a weight llama.cpp ignores).
        block: the repeating layer it belongs to (see the module docstring); None for
            input and output weights.
        kind: llama.cpp's tensor kind (``LLM_TENSOR_`` name without the prefix), or None
            when name rules decided.
        source: ``architecture`` when the file's architecture's table has the name,
            ``table`` when another architecture's table decided, ``names`` for name rules.
    """

    layer_class: LayerClass
    op: str
    block: int | None
    kind: str | None = None
    source: Source = "names"

    @property
    def unused(self) -> bool:
        """llama.cpp loads no data for this weight (its kind's op is ``NONE``)."""
        return self.op == UNUSED_OP


_SUFFIXES = frozenset(SUFFIXES)
_MAX_LAYER_DIGITS = 18  # longer layer numbers are out of range anyway; int() of huge strings is slow


def _template_of(name: str) -> tuple[str, int | None]:
    """``name`` as a template: dot-separated parts of ASCII digits become ``%d``. Returns
    the template and the first such number (None if none)."""
    parts = name.split(".")
    first: int | None = None
    for i, part in enumerate(parts):
        if part.isdigit() and part.isascii():
            if first is None:
                first = int(part) if len(part) <= _MAX_LAYER_DIGITS else 10**_MAX_LAYER_DIGITS
            parts[i] = "%d"
    return ".".join(parts), first


def _op_for(kind: str, suffix: str | None, lora_experts: bool) -> str:
    op = KINDS[kind][2]
    assert op is not None
    if op == UNUSED_OP:
        return op
    if suffix == "bias":
        return "ADD_ID" if op == "MUL_MAT_ID" else "ADD"
    if lora_experts and suffix in ("lora_a", "lora_b"):
        return "MUL_MAT_ID"
    return op


@dataclass(frozen=True, slots=True)
class _TemplateClass:
    """What a name template decides for every weight spelled by it: all of its
    :class:`TensorClass` but the block, and whether the block is the name's number.
    """

    layer_class: LayerClass
    op: str
    kind: str
    source: Source
    numbered: bool

    def for_number(self, first: int | None) -> TensorClass:
        """The class of a weight of this template whose first number is ``first``:
        llama.cpp picks a repeating weight's buffer type list with the number its name
        is built with; kinds without one are created with layer 0's."""
        block = None
        if self.layer_class is LayerClass.REPEATING:
            block = first if self.numbered and first is not None else 0
        return TensorClass(self.layer_class, self.op, block, self.kind, self.source)


def _template_class(kind: str, suffix: str | None, lora_experts: bool, source: Source) -> _TemplateClass:
    template, layer, _ = KINDS[kind]
    assert layer is not None
    return _TemplateClass(LayerClass(layer), _op_for(kind, suffix, lora_experts), kind, source, "%d" in template)


@dataclass(frozen=True)
class ArchitectureTable:
    """The tensor kinds of one architecture, by name template.

    Attributes:
        architecture: the ``general.architecture`` value (None: none given).
        known: llama.cpp has a loader for it.
        templates: name template -> kind (the architecture's kinds that have info).
        tied_output: without an ``output`` weight, ``token_embd`` also serves as the output
            weight (a second copy where the output layer's buffer type differs).
        lora_experts: the architecture sets a router layer (``lora_a`` / ``lora_b`` ->
            ``MUL_MAT_ID``).
    """

    architecture: str | None
    known: bool
    templates: dict[str, str]
    tied_output: bool
    lora_experts: bool
    _seen: dict[str, TensorClass] = field(default_factory=dict, compare=False, repr=False)
    _by_template: dict[str, _TemplateClass | None] = field(default_factory=dict, compare=False, repr=False)

    def classify(self, name: str) -> TensorClass:
        """The layer class and op of the weight ``name`` (llama.cpp's
        ``llm_tensor_info_for`` and the op choice of ``create_tensor``); see the module
        docstring for names outside the table. Answers are kept for the next model of
        the architecture (up to :data:`CLASSIFIED_KEPT` names, and as many templates)."""
        found = self._seen.get(name)
        if found is None:
            found = self._classify(name)
            if len(self._seen) < CLASSIFIED_KEPT:
                self._seen[name] = found
        return found

    def _classify(self, name: str) -> TensorClass:
        template, first = _template_of(name)
        if template in self._by_template:
            decided = self._by_template[template]
        else:
            decided = self._decide(template)
            if len(self._by_template) < CLASSIFIED_KEPT:
                self._by_template[template] = decided
        if decided is None:
            return _by_name_rules(name)
        return decided.for_number(first)

    def _decide(self, template: str) -> _TemplateClass | None:
        """What the tables say of ``template``: the file's architecture's first, then
        every architecture's; None when neither spells it (name rules decide)."""
        candidates: list[tuple[str, str | None]] = [(template, None)]
        base, dot, last = template.rpartition(".")
        if dot and last in _SUFFIXES:
            candidates.append((base, last))
        for tmpl, sfx in candidates:
            kind = self.templates.get(tmpl)
            if kind is not None:
                return _template_class(kind, sfx, self.lora_experts, "architecture")
        every = _all_templates()
        for tmpl, sfx in candidates:
            kind = every.get(tmpl)
            if kind is not None:
                return _template_class(kind, sfx, self.lora_experts, "table")
        return None


@cache
def _all_templates() -> dict[str, str]:
    """Template -> kind over every kind that has info; where kinds share a template, the
    one more architectures use (then the first by name)."""
    uses = Counter(k for kinds in ARCHITECTURES.values() for k in kinds)
    out: dict[str, str] = {}
    for kind in sorted(KINDS, key=lambda k: (-uses[k], k)):
        template, layer, _ = KINDS[kind]
        if layer is not None:
            out.setdefault(template, kind)
    return out


CLASSIFIED_KEPT = 1 << 16
"""Weight names whose class one architecture's table keeps."""


@lru_cache(maxsize=64)
def table_for(architecture: str | None) -> ArchitectureTable:
    """The table of ``architecture`` (an unknown one gets an empty table, so every name
    is classified by the fallback rules)."""
    kinds = ARCHITECTURES.get(architecture or "")
    known = kinds is not None
    templates = {KINDS[k][0]: k for k in kinds or () if KINDS[k][1] is not None}
    return ArchitectureTable(
        architecture=architecture,
        known=known,
        templates=templates,
        tied_output=architecture in TIED_OUTPUT or not known,
        lora_experts=architecture in LORA_EXPERTS,
    )


def classify(name: str, architecture: str | None = None) -> TensorClass:
    """The layer class and op of the weight ``name`` in a file of ``architecture``
    (``general.architecture``; None: classified as for an unknown architecture)."""
    return table_for(architecture).classify(name)


# --- name rules: for names no architecture's table spells ---------------------------------

_BLOCK = re.compile(r"^blk\.([0-9]+)\.(.+)$")

# ops of repeating-layer weights that are neither matrix products nor norms
_BLOCK_OPS: dict[str, str] = {
    "ssm_conv1d": "SSM_CONV",
    "shortconv.conv": "SSM_CONV",
    "ssm_a": "SSM_SCAN",
    "ssm_d": "MUL",
    "time_mix_first": "RWKV_WKV6",
    "attn_sinks": "SCALE",
    "exp_probs_b": "ADD",
    "conv1d": "IM2COL",
}


def _base_and_suffix(name: str) -> tuple[str, str]:
    base, dot, suffix = name.rpartition(".")
    return (base, suffix) if dot and suffix in _SUFFIXES else (name, "")


def _block_op(base: str) -> str:
    if base in _BLOCK_OPS:
        return _BLOCK_OPS[base]
    if base.endswith(("_exps", "_chexps")):
        return "MUL_MAT_ID"
    if base.endswith("_norm") or base.startswith("layer_output_norm") or "norm" in base.split("_"):
        return "MUL"
    if base.startswith("time_mix_lerp") or base in ("time_mix_w0", "time_mix_a0", "time_mix_v0", "time_mix_decay"):
        return "ADD"
    return "MUL_MAT"


def _by_name_rules(name: str) -> TensorClass:
    """``blk.N.*`` weights are repeating, their op from their name; other weights are
    input weights (kept on the CPU, like the embeddings)."""
    m = _BLOCK.match(name)
    if m is not None:
        base, suffix = _base_and_suffix(m.group(2))
        op = _block_op(base)
        if suffix == "bias":
            op = "ADD_ID" if op == "MUL_MAT_ID" else "ADD"
        digits = m.group(1)
        block = int(digits) if len(digits) <= _MAX_LAYER_DIGITS else 10**_MAX_LAYER_DIGITS
        return TensorClass(LayerClass.REPEATING, op, block)
    _, suffix = _base_and_suffix(name)
    return TensorClass(LayerClass.INPUT, "ADD" if suffix == "bias" else "GET_ROWS", None)
