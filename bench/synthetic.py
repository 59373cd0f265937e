"""Write a synthetic llama-shaped GGUF model of a given size (random Q8_0 blocks), for
load benchmarks on a model bigger than the bundled samples.

    .venv/bin/python bench/synthetic.py PATH [--gib 2.1]

The tensor bytes are random (not valid weights: do not load it with check-tensors).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import gguf  # noqa: E402
import numpy as np  # noqa: E402

EMBED = 2048
FFN = 5632
VOCAB = 32000


def q8_rows(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Random bytes shaped as ``rows`` rows of Q8_0 blocks (34 bytes per 32 values)."""
    return rng.integers(0, 256, size=(rows, cols // 32 * 34), dtype=np.uint8)


def write(path: Path, gib: float) -> int:
    """Write the model; returns its size in bytes."""
    rng = np.random.default_rng(0)
    per_block = 4 * EMBED * EMBED + 3 * EMBED * FFN
    blocks = max(1, int((gib * (1 << 30) - 2 * VOCAB * EMBED * 34 / 32) / (per_block * 34 / 32)) + 1)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(blocks)
    q8 = gguf.GGMLQuantizationType.Q8_0
    writer.add_tensor("token_embd.weight", q8_rows(rng, VOCAB, EMBED), raw_dtype=q8)
    writer.add_tensor("output_norm.weight", np.ones(EMBED, dtype=np.float32))
    writer.add_tensor("output.weight", q8_rows(rng, VOCAB, EMBED), raw_dtype=q8)
    for i in range(blocks):
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"blk.{i}.{name}.weight", q8_rows(rng, EMBED, EMBED), raw_dtype=q8)
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", q8_rows(rng, FFN, EMBED), raw_dtype=q8)
        writer.add_tensor(f"blk.{i}.ffn_up.weight", q8_rows(rng, FFN, EMBED), raw_dtype=q8)
        writer.add_tensor(f"blk.{i}.ffn_down.weight", q8_rows(rng, EMBED, FFN), raw_dtype=q8)
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(EMBED, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(EMBED, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.stat().st_size


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", type=Path)
    parser.add_argument("--gib", type=float, default=2.1, help="tensor data in GiB (default 2.1)")
    args = parser.parse_args()
    size = write(args.path, args.gib)
    sys.stdout.write(f"{args.path}: {size / (1 << 30):.2f} GiB\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
