"""What is known about each bundled real model from outside hoist (its model card, gguf-py,
llama.cpp's recorded placements), for the tests that run on every one of them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.sample import SAMPLES

ORACLE: dict[str, dict[str, Any]] = json.loads(
    (Path(__file__).resolve().parent / "data" / "oracle_configs.json").read_text()
)
"""llama.cpp's recorded placements (tests/data/oracle_README.md)."""


@dataclass(frozen=True)
class SampleFacts:
    """Facts of one bundled model's file.

    Attributes:
        oracle_model: the ``model`` name its records in ``ORACLE`` carry.
        oracle_all_layers: the record of ``-ngl 99`` under mmap on two devices of equal memory.
        architecture: ``general.architecture``.
        file_type_name: llama.cpp's name of its ``general.file_type``.
        n_tensors: tensors in the file.
        n_vocab: entries of ``tokenizer.ggml.tokens``.
        tensor_types: tensors per ggml type.
        bad_scale: a quantized type of the file, its block size in bytes, and the name
            and byte offset in the block of one f16 scale (for corrupting a block).
    """

    oracle_model: str
    oracle_all_layers: str
    architecture: str
    file_type_name: str
    n_tensors: int
    n_vocab: int
    tensor_types: dict[str, int]
    bad_scale: tuple[str, int, str, int]


FACTS: dict[str, SampleFacts] = {
    "gemma3": SampleFacts(
        oracle_model="sample",
        oracle_all_layers="A99",
        architecture="gemma3",
        file_type_name="Q4_K - Medium",
        n_tensors=236,
        n_vocab=262144,
        tensor_types={"F32": 109, "Q5_0": 81, "Q4_K": 27, "Q8_0": 10, "Q6_K": 9},
        bad_scale=("Q4_K", 144, "dmin", 2),
    ),
    "smollm2": SampleFacts(
        oracle_model="smollm2",
        oracle_all_layers="M99",
        architecture="llama",
        file_type_name="Q4_1",
        n_tensors=272,
        n_vocab=49152,
        tensor_types={"Q4_1": 210, "F32": 61, "Q8_0": 1},
        bad_scale=("Q4_1", 20, "m", 2),
    ),
}
assert FACTS.keys() == SAMPLES.keys()


def tensor_data_span(reader: Any) -> int:
    """Bytes from the first tensor's data to the end of the last one's, as gguf-py reads them."""
    starts = [int(t.data_offset) for t in reader.tensors]
    ends = [int(t.data_offset) + int(t.n_bytes) for t in reader.tensors]
    return max(ends) - min(starts)
