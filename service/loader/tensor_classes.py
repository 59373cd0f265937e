"""What each weight is: its layer class (input, output or repeating layer ``blk.N``) and
the op that consumes it (llama.cpp's ``llm_tensor_info`` table), from its GGUF name.

The layer class decides which buffer type list a tensor is placed with; the op decides
whether a device can hold it (``weight_buft_supported``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum


class LayerClass(StrEnum):
    """llama.cpp's ``llm_tensor_layer``."""

    INPUT = "input"
    OUTPUT = "output"
    REPEATING = "repeating"


@dataclass(frozen=True, slots=True)
class TensorClass:
    """How a weight is used.

    Attributes:
        layer_class: input, output or repeating.
        op: the ggml op that consumes the weight (``MUL_MAT``, ``GET_ROWS``, ...).
        block: the repeating layer it belongs to (``blk.N`` gives N; repeating weights
            without a block number, such as ``rope_freqs``, belong to layer 0, where
            llama.cpp creates them); None for input and output weights.
    """

    layer_class: LayerClass
    op: str
    block: int | None


_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")

# weights outside the repeating layers: base name -> (layer class, op)
_TOP_LEVEL: dict[str, tuple[LayerClass, str]] = {
    "token_embd": (LayerClass.INPUT, "GET_ROWS"),
    "pos_embd": (LayerClass.INPUT, "GET_ROWS"),
    "token_types": (LayerClass.INPUT, "GET_ROWS"),
    "per_layer_token_embd": (LayerClass.INPUT, "GET_ROWS"),
    "output": (LayerClass.OUTPUT, "MUL_MAT"),
    "cls": (LayerClass.OUTPUT, "MUL_MAT"),
    "cls.output": (LayerClass.OUTPUT, "MUL_MAT"),
    "output_norm": (LayerClass.OUTPUT, "MUL"),
    "enc.output_norm": (LayerClass.OUTPUT, "MUL"),
    "dec.output_norm": (LayerClass.OUTPUT, "MUL"),
    # norms of the embeddings run in the first layer, not the input layer
    "token_embd_norm": (LayerClass.REPEATING, "MUL"),
    "rope_freqs": (LayerClass.REPEATING, "ROPE"),
    "rope_factors_long": (LayerClass.REPEATING, "ROPE"),
    "rope_factors_short": (LayerClass.REPEATING, "ROPE"),
}

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
    return (base, suffix) if dot and suffix in ("weight", "bias", "scale") else (name, "")


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


def classify(name: str) -> TensorClass:
    """The layer class and op of the weight ``name``.

    ``blk.N.*`` weights are repeating; their op follows their name (``*_exps`` ->
    ``MUL_MAT_ID``, norms -> ``MUL``, biases -> ``ADD``, the rest ``MUL_MAT``). Known
    top-level names follow llama.cpp's table; other top-level weights are treated as
    input weights (kept on the CPU, like the embeddings).
    """
    m = _BLOCK.match(name)
    if m is not None:
        base, suffix = _base_and_suffix(m.group(2))
        op = _block_op(base)
        if suffix == "bias":
            op = "ADD_ID" if op == "MUL_MAT_ID" else "ADD"
        return TensorClass(LayerClass.REPEATING, op, int(m.group(1)))
    base, suffix = _base_and_suffix(name)
    layer_class, op = _TOP_LEVEL.get(base, (LayerClass.INPUT, "GET_ROWS"))
    if suffix == "bias":
        op = "ADD"
    return TensorClass(layer_class, op, 0 if layer_class is LayerClass.REPEATING else None)
