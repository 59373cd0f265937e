"""Where a llama.cpp source tree is, for the tests that compare hoist with it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

ENV = "HOIST_LLAMA_CPP_DIR"


def llama_cpp_dir() -> Path | None:
    """The llama.cpp tree named by ``$HOIST_LLAMA_CPP_DIR``, else one vendored by a
    llama-cpp-python source tree in ``llama-src/`` beside the checkout; ``None`` if there
    is none."""
    named = os.environ.get(ENV)
    candidates = [Path(named)] if named else sorted((ROOT.parent / "llama-src").glob("*/vendor/llama.cpp"))
    for path in candidates:
        if (path / "ggml" / "include" / "ggml.h").is_file():
            return path
    return None


def require_llama_cpp() -> Path:
    """The llama.cpp tree, or skip the test saying how to provide one."""
    path = llama_cpp_dir()
    if path is None:
        pytest.skip(f"no llama.cpp source tree: set {ENV} to one (holding ggml/include/ggml.h) to compare with it")
    return path
