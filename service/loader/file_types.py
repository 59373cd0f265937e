"""Names of GGUF file types (``general.file_type``), as llama.cpp prints them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

# general.file_type value -> llama.cpp's llama_ftype_name
FILE_TYPE_NAMES: dict[int, str] = {
    0: "all F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K - Medium",
    11: "Q3_K - Small",
    12: "Q3_K - Medium",
    13: "Q3_K - Large",
    14: "Q4_K - Small",
    15: "Q4_K - Medium",
    16: "Q5_K - Small",
    17: "Q5_K - Medium",
    18: "Q6_K",
    19: "IQ2_XXS - 2.0625 bpw",
    20: "IQ2_XS - 2.3125 bpw",
    21: "Q2_K - Small",
    22: "IQ3_XS - 3.3 bpw",
    23: "IQ3_XXS - 3.0625 bpw",
    24: "IQ1_S - 1.5625 bpw",
    25: "IQ4_NL - 4.5 bpw",
    26: "IQ3_S - 3.4375 bpw",
    27: "IQ3_S mix - 3.66 bpw",
    28: "IQ2_S - 2.5 bpw",
    29: "IQ2_M - 2.7 bpw",
    30: "IQ4_XS - 4.25 bpw",
    31: "IQ1_M - 1.75 bpw",
    32: "BF16",
    36: "TQ1_0 - 1.69 bpw ternary",
    37: "TQ2_0 - 2.06 bpw ternary",
    38: "MXFP4 MoE",
    39: "NVFP4",
    40: "Q1_0",
    41: "Q2_0",
}

# the file type llama.cpp guesses from the most common tensor type, when the key is absent
_GUESS: dict[str, int] = {
    "F32": 0, "F16": 1, "BF16": 32, "Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q5_1": 9, "Q8_0": 7,
    "Q2_K": 10, "Q3_K": 12, "Q4_K": 15, "Q5_K": 17, "Q6_K": 18, "TQ1_0": 36, "TQ2_0": 37,
    "IQ2_XXS": 19, "IQ2_XS": 20, "IQ2_S": 28, "IQ3_XXS": 23, "IQ1_S": 24, "IQ1_M": 31,
    "IQ4_NL": 25, "IQ4_XS": 30, "IQ3_S": 26, "MXFP4": 38, "NVFP4": 39, "Q1_0": 40,
}  # fmt: skip


def file_type_name(file_type: int | None, tensor_types: Iterable[str] = ()) -> str:
    """The name of ``file_type`` (``general.file_type``); without it, the type guessed
    from the most common of ``tensor_types`` with ``(guessed)`` appended."""
    if file_type is not None:
        return FILE_TYPE_NAMES.get(file_type, "unknown, may not work")
    counts = Counter(tensor_types)
    if not counts:
        return "unknown"
    guess = _GUESS.get(counts.most_common(1)[0][0])
    return (FILE_TYPE_NAMES[guess] if guess is not None else "unknown, may not work") + " (guessed)"
