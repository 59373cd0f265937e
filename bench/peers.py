"""hoist's loader side by side with llama.cpp's own loader, on the same files, warm and cold.

    .venv/bin/python bench/peers.py [PATH ...] [--models gemma3,smollm2,synthetic]
        [--modes none,mmap,mlock,mmap+mlock,direct-io] [--cache warm,cold] [--repeat N]
        [--llama-lib-dir DIR] [--llama-cpp-dir DIR] [--work-dir DIR] [--synthetic-gib G]
        [--fast-samples N] [--evict auto|drop-caches|fadvise] [--json FILE] [--markdown]
    .venv/bin/python bench/peers.py --summarize FILE [--markdown]

llama.cpp's side is ``bench/llama_load.c``, a small program of ours linked to ``libllama``:
one ``llama_model_load_from_file`` onto the CPU alone (``n_gpu_layers`` 0, no extra buffer
types, no tensor checks, lazy reading off). ``libllama`` comes from, in this order:
``--llama-lib-dir`` (an existing build; headers from ``--llama-cpp-dir`` or beside the
libraries), a build of ``--llama-cpp-dir`` (``$HOIST_LLAMA_CPP_DIR``), or a build of the
llama-cpp-python source package (``pip download``), unpacked in the work directory. Builds
are kept in the work directory and reused.

hoist's side runs its Python API in every mode: ``open_model`` then ``load_model`` on the
CPU device. The baseline reads the file's tensor data into fresh memory with plain
sequential reads (``bench/load.py``'s baseline: buffered 16 MiB ``preadv`` calls, and
64 MiB ``O_DIRECT`` reads).

Two times per load, from CLOCK_MONOTONIC:
- ``load``: the whole call (llama.cpp: ``llama_model_load_from_file``; hoist: parse, plan
  and load);
- ``tensors``: first to last call of the progress callback. llama.cpp calls it first once
  the file is parsed and mapped and its buffers are allocated (with mmap the pages are
  populated by then), hoist before it maps or allocates anything; so ``load`` is the like
  for like comparison and ``tensors`` shows where the time goes.

Models: the bundled ``gemma3`` sample and ``smollm2`` (placed in the work directory as
``hoist sample`` does), ``synthetic``: a llama-architecture F16 model of at least
``--synthetic-gib`` GiB that this script writes once into the work directory, and any PATH.

Every measurement runs in a fresh process; per round, every configuration runs once,
hoist and llama.cpp of one mode back to back (which goes first alternates by round).
A configuration whose loads all ran under 100 ms on both sides in those rounds then gets
more rounds, of it alone, up to ``--fast-samples`` in all (default 15): at that length a
busy machine's noise is a large part of each load.
Warm: the file is read once before the round and stays cached. Cold: before each
measurement the file is evicted from the page cache (``drop-caches``: ``sync`` and
``3 > /proc/sys/vm/drop_caches``, which evicts every cached file, programs and libraries
too, and so disturbs whatever else runs on the machine; ``fadvise``: ``fdatasync`` and
``posix_fadvise(DONTNEED)`` of the model file alone, the choice on a shared machine;
``auto``: drop-caches where permitted, else fadvise), then ``mincore``
says how much of it is still resident: the output gives the method and the largest
resident fraction found.

Prints, per model x cache x mode, medians and ranges (min-max) of both times, GB/s of
tensor data, hoist / llama.cpp (lower is better) and hoist / the plain read of the
tensors phase; with ``--markdown``, a table for the README. The machine (CPU, cores, RAM,
kernel, filesystem, transparent huge pages) and the date head the output.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
# this directory holds bench/service.py, which would shadow the ``service`` package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GiB = 1 << 30
MiB = 1 << 20
MODES = ("none", "mmap", "mlock", "mmap+mlock", "direct-io")
MODELS = ("gemma3", "smollm2", "synthetic")
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
SOURCE_ENV = "HOIST_LLAMA_CPP_DIR"
PROGRAM = BENCH / "llama_load.c"
CHILD_TIMEOUT_S = 1800
FAST_SECONDS = 0.1
"""A configuration whose loads all took less than this in the ``--repeat`` rounds (both
sides) gets more rounds, up to ``--fast-samples``: a machine's noise is a large share of
a load this short, and a median of three does not settle it."""
HEAD_DIM = 64
"""Head size of the synthetic model."""


# --------------------------------------------------------------------------------------
# the synthetic model


@dataclass(frozen=True)
class SyntheticShape:
    """Hyperparameters of a llama-architecture model (ggml ne order for the shapes).

    Attributes:
        n_embd: embedding length; a multiple of the head size 64.
        n_ff: feed-forward length.
        n_layer: blocks.
        n_vocab: tokenizer entries (3 control tokens + 256 byte tokens + plain ones).
    """

    n_embd: int
    n_ff: int
    n_layer: int
    n_vocab: int

    @property
    def n_head(self) -> int:
        return self.n_embd // HEAD_DIM

    @property
    def n_head_kv(self) -> int:
        return max(1, self.n_head // 8)

    def tensors(self) -> list[tuple[str, tuple[int, ...], str]]:
        """Every tensor as (name, numpy shape, ``F16`` or ``F32``): the ones llama.cpp's
        llama architecture requires, and ``output``."""
        e, f, v = self.n_embd, self.n_ff, self.n_vocab
        kv = self.n_head_kv * HEAD_DIM
        out: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (v, e), "F16")]
        for i in range(self.n_layer):
            b = f"blk.{i}."
            out += [
                (b + "attn_norm.weight", (e,), "F32"),
                (b + "attn_q.weight", (e, e), "F16"),
                (b + "attn_k.weight", (kv, e), "F16"),
                (b + "attn_v.weight", (kv, e), "F16"),
                (b + "attn_output.weight", (e, e), "F16"),
                (b + "ffn_norm.weight", (e,), "F32"),
                (b + "ffn_gate.weight", (f, e), "F16"),
                (b + "ffn_up.weight", (f, e), "F16"),
                (b + "ffn_down.weight", (e, f), "F16"),
            ]
        out += [("output_norm.weight", (e,), "F32"), ("output.weight", (v, e), "F16")]
        return out

    def tensor_nbytes(self) -> int:
        """Bytes of tensor data (without alignment padding)."""
        return sum(_prod(shape) * (2 if t == "F16" else 4) for _, shape, t in self.tensors())

    @property
    def file_name(self) -> str:
        return f"synthetic-llama-f16-e{self.n_embd}-ff{self.n_ff}-l{self.n_layer}-v{self.n_vocab}.gguf"


def _prod(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def synthetic_shape(min_nbytes: int, *, n_embd: int = 2048, n_vocab: int = 512) -> SyntheticShape:
    """The shape with the fewest blocks whose tensor data holds at least ``min_nbytes``
    (``n_ff`` about 2.75 x ``n_embd``, rounded to 64, as in small llama models).

    Raises:
        ValueError: ``n_embd`` is not a positive multiple of 64, ``n_vocab`` < 259, or the
            size asks for more than 100000 blocks.
    """
    if n_embd <= 0 or n_embd % HEAD_DIM:
        raise ValueError(f"n_embd is {n_embd}, it must be a positive multiple of {HEAD_DIM}")
    if n_vocab < 259:
        raise ValueError(f"n_vocab is {n_vocab}, it must hold 3 control tokens and 256 byte tokens")
    n_ff = (n_embd * 11 // 4 + 63) // 64 * 64
    base = SyntheticShape(n_embd, n_ff, 0, n_vocab).tensor_nbytes()
    per_layer = SyntheticShape(n_embd, n_ff, 1, n_vocab).tensor_nbytes() - base
    n_layer = max(1, -(-(min_nbytes - base) // per_layer))
    if n_layer > 100_000:
        raise ValueError(f"{min_nbytes} bytes would need {n_layer} blocks of n_embd {n_embd}; use a larger n_embd")
    return SyntheticShape(n_embd, n_ff, n_layer, n_vocab)


def write_synthetic(path: Path, shape: SyntheticShape, *, seed: int = 0) -> Path:
    """Write a llama-architecture GGUF file llama.cpp loads: hyperparameters, a minimal
    SentencePiece vocabulary (``<unk>``, ``<s>``, ``</s>``, the 256 byte tokens, then
    plain ones), F32 norms of ones and F16 weights of finite normal values (slices of one
    shared random block, so that memory stays small whatever the file's size). Written
    under a temporary name and renamed. Returns ``path``."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    biggest = max(_prod(s) for _, s, t in shape.tensors() if t == "F16")
    slack = 1 << 16
    block = (rng.standard_normal(biggest + slack, dtype=np.float32) * 0.02).astype(np.float16)
    ones = np.ones(shape.n_embd, dtype=np.float32)

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    try:
        writer.add_name("hoist synthetic llama")
        writer.add_context_length(4096)
        writer.add_embedding_length(shape.n_embd)
        writer.add_block_count(shape.n_layer)
        writer.add_feed_forward_length(shape.n_ff)
        writer.add_head_count(shape.n_head)
        writer.add_head_count_kv(shape.n_head_kv)
        writer.add_rope_dimension_count(HEAD_DIM)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_vocab_size(shape.n_vocab)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
        tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
        types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
        types += [gguf.TokenType.BYTE] * 256
        plain = shape.n_vocab - len(tokens)
        tokens += [f"t{i}" for i in range(plain)]
        types += [gguf.TokenType.NORMAL] * plain
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores([-float(i) for i in range(shape.n_vocab)])
        writer.add_token_types(types)
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        for i, (name, dims, kind) in enumerate(shape.tensors()):
            if kind == "F32":
                writer.add_tensor(name, ones)
            else:
                start = (i * 4099) % slack
                writer.add_tensor(name, block[start : start + _prod(dims)].reshape(dims))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def synthetic_model(work_dir: Path, min_nbytes: int) -> Path:
    """The synthetic model of at least ``min_nbytes`` of tensor data in ``work_dir``,
    written unless it is there already."""
    shape = synthetic_shape(min_nbytes)
    path = work_dir / shape.file_name
    if not path.is_file():
        work_dir.mkdir(parents=True, exist_ok=True)
        write_synthetic(path, shape)
    return path


# --------------------------------------------------------------------------------------
# llama.cpp's side: libllama and our program


@dataclass(frozen=True)
class LlamaBuild:
    """Where ``libllama`` and the headers it was built with are."""

    lib_dir: Path
    include_dirs: tuple[Path, ...]
    origin: str


def _has_headers(tree: Path) -> bool:
    return (tree / "include" / "llama.h").is_file() and (tree / "ggml" / "include" / "ggml.h").is_file()


def _tree_includes(tree: Path) -> tuple[Path, ...]:
    return (tree / "include", tree / "ggml" / "include")


def download_source(work_dir: Path) -> Path:
    """The llama.cpp tree vendored by the llama-cpp-python source package, downloaded with
    pip into ``work_dir`` and unpacked there (reused when present).

    Raises:
        RuntimeError: pip failed or the package holds no llama.cpp tree.
    """
    name = LLAMA_CPP_PYTHON.replace("-", "_").replace("==", "-")
    tree = work_dir / name / "vendor" / "llama.cpp"
    if _has_headers(tree):
        return tree
    work_dir.mkdir(parents=True, exist_ok=True)
    archive = work_dir / f"{name}.tar.gz"
    if not archive.is_file():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", LLAMA_CPP_PYTHON]
        done = subprocess.run([*cmd, "-d", str(work_dir)], capture_output=True, text=True)
        if done.returncode != 0 or not archive.is_file():
            raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()[-2000:]}")
    with tarfile.open(archive) as tar:
        tar.extractall(work_dir, filter="data")
    if not _has_headers(tree):
        raise RuntimeError(f"{archive} holds no llama.cpp tree at {tree.relative_to(work_dir)}")
    return tree


def build_libllama(tree: Path, build_dir: Path, *, jobs: int | None = None) -> Path:
    """Configure ``tree`` with CMake (shared libraries, native CPU code, no tests,
    examples, tools or server) and build only the ``llama`` target into ``build_dir``;
    reused when ``build_dir/bin/libllama.so`` exists. Returns the library directory.

    Raises:
        RuntimeError: cmake is missing or failed.
    """
    lib_dir = build_dir / "bin"
    if (lib_dir / "libllama.so").is_file():
        return lib_dir
    if shutil.which("cmake") is None:
        raise RuntimeError("cmake is not installed: it builds libllama from the llama.cpp tree")
    configure = [
        "cmake",
        "-S",
        str(tree),
        "-B",
        str(build_dir),
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=ON",
        "-DGGML_NATIVE=ON",
        "-DGGML_BACKEND_DL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_TOOLS=OFF",
        "-DLLAMA_BUILD_SERVER=OFF",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_OPENSSL=OFF",
    ]
    build = ["cmake", "--build", str(build_dir), "--target", "llama", "-j", str(jobs or os.cpu_count() or 1)]
    for cmd in (configure, build):
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed: {(done.stdout + done.stderr).strip()[-3000:]}")
    return lib_dir


def find_llama(llama_lib_dir: Path | None, llama_cpp_dir: Path | None, work_dir: Path) -> LlamaBuild:
    """libllama and its headers, as the module docstring says.

    Raises:
        RuntimeError: the named directories lack the library or the headers, or building
            failed.
    """
    if llama_lib_dir is not None:
        if not (llama_lib_dir / "libllama.so").is_file():
            raise RuntimeError(f"{llama_lib_dir} holds no libllama.so")
        if llama_cpp_dir is not None:
            if not _has_headers(llama_cpp_dir):
                raise RuntimeError(f"{llama_cpp_dir} holds no include/llama.h and ggml/include/ggml.h")
            includes = _tree_includes(llama_cpp_dir)
        else:
            installed = llama_lib_dir.parent / "include"
            if not (installed / "llama.h").is_file() or not (installed / "ggml.h").is_file():
                raise RuntimeError(f"no llama.h and ggml.h in {installed}: name the source tree with --llama-cpp-dir")
            includes = (installed,)
        return LlamaBuild(llama_lib_dir, includes, f"existing build {llama_lib_dir}")
    if llama_cpp_dir is not None:
        if not _has_headers(llama_cpp_dir):
            raise RuntimeError(f"{llama_cpp_dir} holds no include/llama.h and ggml/include/ggml.h")
        tree, origin = llama_cpp_dir, f"built from {llama_cpp_dir}"
    else:
        tree = download_source(work_dir / "src")
        origin = f"built from the {LLAMA_CPP_PYTHON} source package"
    lib_dir = build_libllama(tree, work_dir / f"llama-build-{_path_key(tree)}")
    return LlamaBuild(lib_dir, _tree_includes(tree), origin)


def _path_key(path: Path) -> str:
    import hashlib

    return hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]


def compile_program(build: LlamaBuild, out_dir: Path) -> Path:
    """Compile ``bench/llama_load.c`` against ``build`` (rpath to its libraries) into
    ``out_dir``, unless a binary newer than the source for the same build is there.

    Raises:
        RuntimeError: no C compiler, or it failed.
    """
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc, or $CC) to build bench/llama_load.c")
    out_dir.mkdir(parents=True, exist_ok=True)
    binary = out_dir / f"llama_load-{_path_key(build.lib_dir)}"
    if binary.is_file() and binary.stat().st_mtime >= PROGRAM.stat().st_mtime:
        return binary
    lib = str(build.lib_dir.resolve())
    cmd = [cc, "-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", "-o", str(binary), str(PROGRAM)]
    cmd += [f"-I{d}" for d in build.include_dirs]
    cmd += [f"-L{lib}", "-lllama", "-lggml", "-lggml-base", f"-Wl,-rpath,{lib}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()[-3000:]}")
    return binary


# --------------------------------------------------------------------------------------
# the page cache


def resident_fraction(path: Path) -> float:
    """Fraction of ``path``'s pages in the page cache (``mincore`` of a fresh mapping)."""
    import numpy as np

    size = path.stat().st_size
    if size == 0:
        return 0.0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = os.sysconf("SC_PAGE_SIZE")
    n_pages = -(-size // page)
    fd = os.open(path, os.O_RDONLY)
    try:
        prot_read, map_shared = 1, 1
        addr = libc.mmap(None, size, prot_read, map_shared, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            vec = (ctypes.c_ubyte * n_pages)()
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return float((np.frombuffer(bytes(vec), dtype=np.uint8) & 1).sum()) / n_pages


def warm(path: Path) -> None:
    """Read the whole file once so that its pages are cached."""
    with open(path, "rb", buffering=0) as f:
        while f.read(16 * MiB):
            pass


DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def evict(path: Path, method: str) -> str:
    """Evict ``path`` from the page cache; returns the method used (``drop-caches``,
    or ``fadvise`` where drop_caches is refused or not asked for)."""
    if method in ("auto", "drop-caches"):
        try:
            os.sync()
            DROP_CACHES.write_text("3\n")
            return "drop-caches"
        except OSError:
            if method == "drop-caches":
                raise
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)  # dirty pages stay cached until written back
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return "fadvise"


# --------------------------------------------------------------------------------------
# one measurement per process


def hoist_child(path: str, mode: str) -> dict[str, Any]:
    """hoist's load of ``path`` in ``mode`` onto the CPU device, timed in this process."""
    import asyncio

    from service.loader.devices import CPUDevice
    from service.loader.pipeline import Progress, load_model
    from service.loader.placement import LazyMode, LoadMode, PlacementParams
    from service.loader.weights import open_model

    marks: list[float] = []
    last_done = [0]

    def on_progress(p: Progress) -> None:
        marks.append(time.monotonic())
        last_done[0] = p.bytes_done

    async def run() -> tuple[float, int]:
        start = time.monotonic()
        index = open_model(path)
        params = PlacementParams(load_mode=LoadMode.parse(mode), lazy_mode=LazyMode.OFF)
        model = await load_model(index, devices=[CPUDevice()], params=params, on_progress=on_progress)
        seconds = time.monotonic() - start
        model.close()
        return seconds, index.nbytes

    load_s, nbytes = asyncio.run(run())
    return {
        "load_s": load_s,
        "tensors_s": marks[-1] - marks[0] if marks else 0.0,
        "progress_calls": len(marks),
        "bytes_done": last_done[0],
        "tensor_bytes": nbytes,
    }


def read_child(path: str, how: str) -> dict[str, Any]:
    """bench/load.py's plain read of the tensor data (``buffered`` or ``direct``)."""
    spec = importlib.util.spec_from_file_location("bench_load", BENCH / "load.py")
    assert spec is not None and spec.loader is not None
    load = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(load)
    out = load.child("baseline", path, how)
    return {"load_s": out["seconds"], "tensors_s": out["seconds"], "tensor_bytes": out["tensor_bytes"]}


def run_child(cmd: Sequence[str]) -> dict[str, Any]:
    """Run one measurement process; its last stdout line is its JSON.

    Raises:
        RuntimeError: it failed.
    """
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"`{' '.join(cmd)}` exited {done.returncode}: {(done.stdout + done.stderr)[-2000:]}")
    out: dict[str, Any] = json.loads(lines[-1])
    return out


# --------------------------------------------------------------------------------------
# the summary


@dataclass(frozen=True)
class Spread:
    """Median and range of some seconds."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("no values")
        return cls(statistics.median(values), min(values), max(values), len(values))


@dataclass(frozen=True)
class Row:
    """One model x cache x mode: hoist's and llama.cpp's times, and the baseline read's.

    Ratios are of medians, hoist over the other (lower is better); ``vs_read`` compares
    hoist's tensors phase with the plain read (the ``O_DIRECT`` read for ``direct-io``,
    the buffered one otherwise). GB/s are tensor bytes over median seconds (1e9 bytes).
    """

    model: str
    cache: str
    mode: str
    tensor_bytes: int
    hoist_load: Spread
    hoist_tensors: Spread
    llama_load: Spread | None
    llama_tensors: Spread | None
    read: Spread | None

    @property
    def ratio_load(self) -> float | None:
        return self.hoist_load.median / self.llama_load.median if self.llama_load else None

    @property
    def ratio_tensors(self) -> float | None:
        return self.hoist_tensors.median / self.llama_tensors.median if self.llama_tensors else None

    @property
    def vs_read(self) -> float | None:
        return self.hoist_tensors.median / self.read.median if self.read else None

    def gbps(self, spread: Spread | None) -> float | None:
        return self.tensor_bytes / spread.median / 1e9 if spread and spread.median > 0 else None


def summarize(runs: Sequence[dict[str, Any]]) -> list[Row]:
    """Rows from measurement records (keys ``model``, ``cache``, ``side`` = ``hoist``,
    ``llama`` or ``read``, ``mode`` (``buffered``/``direct`` for reads), ``load_s``,
    ``tensors_s``, ``tensor_bytes``; those with ``error`` are left out), one per model x
    cache x hoist mode, in first-seen order."""
    groups: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    for r in runs:
        if "error" in r:
            continue
        groups.setdefault((r["model"], r["cache"], r["side"], r["mode"]), []).append(r)

    def spread(key: tuple[str, str, str, str], field: str) -> Spread | None:
        found = groups.get(key)
        return Spread.of([r[field] for r in found]) if found else None

    rows = []
    for (model, cache, side, mode), found in groups.items():
        if side != "hoist":
            continue
        read_mode = "direct" if mode == "direct-io" else "buffered"
        hoist_load = spread((model, cache, "hoist", mode), "load_s")
        hoist_tensors = spread((model, cache, "hoist", mode), "tensors_s")
        assert hoist_load is not None and hoist_tensors is not None
        rows.append(
            Row(
                model=model,
                cache=cache,
                mode=mode,
                tensor_bytes=found[0]["tensor_bytes"],
                hoist_load=hoist_load,
                hoist_tensors=hoist_tensors,
                llama_load=spread((model, cache, "llama", mode), "load_s"),
                llama_tensors=spread((model, cache, "llama", mode), "tensors_s"),
                read=spread((model, cache, "read", read_mode), "tensors_s"),
            )
        )
    return rows


def _ms(s: Spread | None) -> str:
    return "-" if s is None else f"{s.median * 1000:.0f} ({s.low * 1000:.0f}-{s.high * 1000:.0f})"


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def text_table(rows: Sequence[Row]) -> list[str]:
    """The rows as aligned text: milliseconds as median (min-max)."""
    head = (
        f"{'model':<10} {'cache':<5} {'mode':<10} | {'hoist load ms':>20} {'llama load ms':>20} {'ratio':>5} | "
        f"{'hoist tensors ms':>20} {'llama tensors ms':>20} {'ratio':>5} | "
        f"{'hoist GB/s':>10} {'llama GB/s':>10} {'read ms':>20} {'h/read':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.model:<10} {r.cache:<5} {r.mode:<10} | {_ms(r.hoist_load):>20} {_ms(r.llama_load):>20} "
            f"{_num(r.ratio_load):>5} | {_ms(r.hoist_tensors):>20} {_ms(r.llama_tensors):>20} "
            f"{_num(r.ratio_tensors):>5} | {_num(r.gbps(r.hoist_tensors)):>10} {_num(r.gbps(r.llama_tensors)):>10} "
            f"{_ms(r.read):>20} {_num(r.vs_read):>6}"
        )
    return lines


def markdown_table(rows: Sequence[Row]) -> list[str]:
    """The rows as a Markdown table (milliseconds as median (min-max))."""
    lines = [
        "| model | cache | mode | hoist load ms | llama.cpp load ms | hoist / llama.cpp | "
        "hoist tensors ms | llama.cpp tensors ms | hoist / llama.cpp (tensors) | hoist GB/s | "
        "llama.cpp GB/s | plain read ms | hoist / read |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.cache} | {r.mode} | {_ms(r.hoist_load)} | {_ms(r.llama_load)} | "
            f"{_num(r.ratio_load)} | {_ms(r.hoist_tensors)} | {_ms(r.llama_tensors)} | {_num(r.ratio_tensors)} | "
            f"{_num(r.gbps(r.hoist_tensors))} | {_num(r.gbps(r.llama_tensors))} | {_ms(r.read)} | "
            f"{_num(r.vs_read)} |"
        )
    return lines


# --------------------------------------------------------------------------------------
# the machine


def _first_line(path: str, prefix: str) -> str | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(prefix):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def filesystem_of(path: Path) -> str:
    """``type (device) at mount point`` of the mount holding ``path``, from /proc/mounts."""
    target = str(path.resolve())
    best = ("", "?", "?")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mount, fstype = line.split()[:3]
                inside = target == mount or target.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best[0]):
                    best = (mount, fstype, dev)
    except OSError:
        pass
    return f"{best[1]} ({best[2]}) at {best[0] or '?'}"


def machine(model_dir: Path) -> dict[str, Any]:
    """The machine and the date, for the output's header."""
    mem = _first_line("/proc/meminfo", "MemTotal")
    thp = None
    try:
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        pass
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _first_line("/proc/cpuinfo", "model name") or platform.processor(),
        "cores": os.cpu_count(),
        "ram_gib": round(int(mem.split()[0]) / (1 << 20), 1) if mem else None,
        "kernel": platform.release(),
        "filesystem": filesystem_of(model_dir),
        "transparent_hugepage": thp,
        "hoist_commit": commit.stdout.strip() or None,
        "python": platform.python_version(),
    }


# --------------------------------------------------------------------------------------
# the run


def model_paths(names: Sequence[str], extra: Sequence[Path], work_dir: Path, synthetic_gib: float) -> list[Path]:
    from service.sample import place_sample

    paths = []
    for name in names:
        if name == "synthetic":
            paths.append(synthetic_model(work_dir, int(synthetic_gib * GiB)))
        else:
            paths.append(place_sample(work_dir / "models", name))
    return paths + list(extra)


def bench_model(
    path: Path,
    label: str,
    program: Path,
    *,
    modes: Sequence[str],
    caches: Sequence[str],
    repeat: int,
    evict_method: str,
    log: Any,
    fast_samples: int = 0,
) -> list[dict[str, Any]]:
    """Every configuration on ``path``, ``repeat`` rounds per cache state, then more rounds
    of the fast ones (:data:`FAST_SECONDS`) up to ``fast_samples``; the records."""
    from service.loader.weights import open_model

    tensor_bytes = open_model(path).nbytes
    me = [sys.executable, str(Path(__file__).resolve()), "--child"]
    records: list[dict[str, Any]] = []

    def pairs(rep: int, chosen: Sequence[str]) -> list[tuple[str, str, list[str]]]:
        plan: list[tuple[str, str, list[str]]] = []
        for mode in chosen:
            pair = [
                ("hoist", mode, [*me, "hoist", str(path), mode]),
                ("llama", mode, [str(program), str(path), mode]),
            ]
            plan += pair if rep % 2 == 0 else pair[::-1]
        return plan

    def measure(cache: str, rep: int, plan: Sequence[tuple[str, str, list[str]]]) -> None:
        if cache == "warm":
            warm(path)
        for side, mode, cmd in plan:
            method = evict(path, evict_method) if cache == "cold" else None
            resident = resident_fraction(path)
            rec = {"model": label, "path": str(path), "cache": cache, "rep": rep, "side": side, "mode": mode}
            rec |= {"evict": method, "resident_before": resident, "tensor_bytes": tensor_bytes}
            try:
                out = run_child(cmd)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                records.append(rec | {"error": str(exc)})
                log(f"  {label} {cache} #{rep} {side:<5} {mode:<10} FAILED: {exc}")
                continue
            records.append(rec | out)
            log(
                f"  {label} {cache} #{rep} {side:<5} {mode:<10} load {out['load_s'] * 1000:8.1f} ms  "
                f"tensors {out['tensors_s'] * 1000:8.1f} ms  resident before {resident:.2f}"
            )

    for cache in caches:
        for rep in range(repeat):
            reads = [
                ("read", "buffered", [*me, "read", str(path), "buffered"]),
                ("read", "direct", [*me, "read", str(path), "direct"]),
            ]
            measure(cache, rep, reads + pairs(rep, modes))
        mine = [r for r in records if r["cache"] == cache and r["side"] in ("hoist", "llama")]
        fast = [
            mode
            for mode in modes
            if all("error" not in r and r["load_s"] < FAST_SECONDS for r in mine if r["mode"] == mode)
            and any(r["mode"] == mode for r in mine)
        ]
        for rep in range(repeat, fast_samples if fast else 0):
            measure(cache, rep, pairs(rep, fast))
    return records


def header_lines(info: dict[str, Any], origin: str, records: Sequence[dict[str, Any]], repeat: int) -> list[str]:
    cold = [r for r in records if r["cache"] == "cold"]
    lines = [
        f"date: {info['date']}",
        f"machine: {info['cpu']}, {info['cores']} cores, {info['ram_gib']} GiB RAM, Linux {info['kernel']}, "
        f"filesystem {info['filesystem']}, transparent huge pages: {info['transparent_hugepage']}",
        f"hoist {info['hoist_commit']} (Python {info['python']}); llama.cpp: {origin}",
        f"median (min-max) of {repeat} runs each{_more_runs(records, repeat)}, every run in a fresh process; "
        "ratios are hoist / other (lower is better); h/read compares hoist's tensors phase with a plain read",
    ]
    failed = [r for r in records if "error" in r]
    if failed:
        lines.append(f"{len(failed)} runs failed and are left out: " + "; ".join(r["error"][:200] for r in failed[:3]))
    if cold:
        methods = sorted({r["evict"] for r in cold})
        worst = max(r["resident_before"] for r in cold)
        lines.append(
            f"cold: evicted with {', '.join(methods)}; at most {worst:.1%} of a file still resident before a run"
            + ("" if worst < 0.01 else " (the eviction did not take entirely)")
        )
    return lines


def _more_runs(records: Sequence[dict[str, Any]], repeat: int) -> str:
    """Where fast configurations got more rounds: how many, and which."""
    counts: dict[tuple[str, str, str], int] = {}
    for r in records:
        if r["side"] == "hoist":
            key = (r["model"], r["cache"], r["mode"])
            counts[key] = counts.get(key, 0) + 1
    more = {key: n for key, n in counts.items() if n > repeat}
    if not more:
        return ""
    listed = ", ".join(f"{model} {cache} {mode}" for model, cache, mode in more)
    n = max(more.values())
    return f" ({n} for the configurations whose first {repeat} ran under {FAST_SECONDS * 1000:.0f} ms: {listed})"


def report(info: dict[str, Any], origin: str, records: Sequence[dict[str, Any]], repeat: int, markdown: bool) -> str:
    """The output: header, tensor bytes per model, and the table."""
    rows = summarize(records)
    lines = header_lines(info, origin, records, repeat)
    sizes = {r.model: r.tensor_bytes for r in rows}
    lines += [f"{m}: {n / MiB:.1f} MiB of tensor data" for m, n in sizes.items()]
    lines += [""] + (markdown_table(rows) if markdown else text_table(rows))
    return "\n".join(lines) + "\n"


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind, file, mode = sys.argv[2:5]
        out = hoist_child(file, mode) if kind == "hoist" else read_child(file, mode)
        sys.stdout.write(json.dumps(out) + "\n")
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", type=Path, metavar="PATH", help="more GGUF files to measure")
    parser.add_argument("--models", default=",".join(MODELS), help="of gemma3, smollm2, synthetic (default: all)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--cache", default="warm,cold", help="warm, cold or both (default)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds per cache state (default 3)")
    parser.add_argument(
        "--fast-samples",
        type=int,
        default=15,
        help=f"rounds in all of a configuration whose first --repeat loads took under "
        f"{FAST_SECONDS * 1000:.0f} ms on both sides (default 15; 0: no more rounds)",
    )
    parser.add_argument("--llama-lib-dir", type=Path, help="an existing llama.cpp build's libllama.so directory")
    parser.add_argument(
        "--llama-cpp-dir",
        type=Path,
        default=Path(os.environ[SOURCE_ENV]) if os.environ.get(SOURCE_ENV) else None,
        help=f"a llama.cpp source tree (default ${SOURCE_ENV})",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hoist-peers",
        help="models, sources and builds, kept between runs (default ~/.cache/hoist-peers)",
    )
    parser.add_argument("--synthetic-gib", type=float, default=2.0, help="size of the synthetic model (default 2)")
    parser.add_argument("--evict", choices=("auto", "drop-caches", "fadvise"), default="auto")
    parser.add_argument("--json", type=Path, help="write every measurement and the summary there")
    parser.add_argument("--markdown", action="store_true", help="print the summary as a Markdown table")
    parser.add_argument("--summarize", type=Path, metavar="FILE", help="measure nothing: summarize a --json FILE")
    args = parser.parse_args()
    if args.summarize:
        saved = json.loads(args.summarize.read_text())
        repeat = saved.get("repeat") or 1 + max(r["rep"] for r in saved["runs"])
        sys.stdout.write(report(saved["machine"], saved["llama"], saved["runs"], repeat, args.markdown))
        return 0

    modes = [m for m in args.modes.split(",") if m]
    names = [m for m in args.models.split(",") if m]
    caches = [c for c in args.cache.split(",") if c]
    for value, known, what in ((modes, MODES, "mode"), (names, MODELS, "model"), (caches, ("warm", "cold"), "cache")):
        unknown = set(value) - set(known)
        if unknown:
            parser.error(f"unknown {what}: {', '.join(sorted(unknown))} (known: {', '.join(known)})")
    if not 1 <= args.repeat <= 100:
        parser.error("--repeat must be from 1 to 100")
    if not 0 <= args.fast_samples <= 1000:
        parser.error("--fast-samples must be from 0 to 1000")

    def log(line: str) -> None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    llama = find_llama(args.llama_lib_dir, args.llama_cpp_dir, args.work_dir)
    program = compile_program(llama, args.work_dir / "bin")
    paths = model_paths(names, args.paths, args.work_dir, args.synthetic_gib)
    labels = [*names, *(extra.stem for extra in args.paths)]
    info = machine(paths[0].parent if paths else args.work_dir)
    records: list[dict[str, Any]] = []
    for path, label in zip(paths, labels, strict=True):
        log(f"{label}: {path}")
        records += bench_model(
            path,
            label,
            program,
            modes=modes,
            caches=caches,
            repeat=args.repeat,
            evict_method=args.evict,
            log=log,
            fast_samples=args.fast_samples,
        )
    sys.stdout.write(report(info, llama.origin, records, args.repeat, args.markdown))
    if args.json:
        saved = {"machine": info, "llama": llama.origin, "repeat": args.repeat, "runs": records}
        args.json.write_text(json.dumps(saved, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
