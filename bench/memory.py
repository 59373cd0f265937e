"""Host memory placement, measured: first touch of fresh buffers, huge pages, read-ahead
advice, mmap populate order, and reuse of touched buffers; ratios within one run.

    .venv/bin/python bench/memory.py PATH [--repeat N] [--parts touch,mmap,reuse,cycle]

PATH: a model file (>= 2 GiB to see the effects; ``bench/synthetic.py`` writes one).
Every variant reads the file's whole tensor data range, in 16 MiB ``preadv`` chunks (as
the loader does), into a fresh buffer; repetitions of the variants are interleaved.
Cold runs evict the file with ``posix_fadvise(POSIX_FADV_DONTNEED)`` first and check
with ``mincore`` that at most 1% of it stayed resident (else the run is reported as not
cold). Prints medians (ms) and the ratio to the part's first variant (its time / the
variant's time: above 1.0 is faster).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np  # noqa: E402

from service.io import libc  # noqa: E402
from service.io.align import HUGE_PAGE_SIZE, PAGE_SIZE, aligned_empty, populate_write  # noqa: E402
from service.io.mapping import MADV_POPULATE_READ  # noqa: E402
from service.loader.weights import open_model  # noqa: E402

MiB = 1 << 20
CHUNK = 16 * MiB

_mincore = ctypes.CDLL(None, use_errno=True).mincore
_mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


def resident_fraction(path: str) -> float:
    """Share of the file's pages in the page cache (``mincore`` over a fresh mapping)."""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(size, mmap.PROT_READ, mmap.MAP_SHARED, fd)
    finally:
        os.close(fd)
    try:
        pages = (size + PAGE_SIZE - 1) // PAGE_SIZE
        vec = np.zeros(pages, dtype=np.uint8)
        if _mincore(addr, size, vec.ctypes.data) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        return float(np.count_nonzero(vec & 1)) / pages
    finally:
        libc.munmap(addr, size)


def evict(path: str) -> None:
    """Drop the file's clean pages from the page cache; raise unless they went."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    left = resident_fraction(path)
    if left > 0.01:
        raise RuntimeError(f"{path} is still {left:.1%} resident after POSIX_FADV_DONTNEED")


def warm(path: str) -> None:
    """Read the whole file once so that it is in the page cache."""
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(CHUNK)
        while f.readinto(buf):
            pass


def data_range(path: str) -> tuple[int, int, list[tuple[int, int]]]:
    """First and end offset of the tensor data and each tensor's (offset, nbytes) in
    the order the index lists them."""
    index = open_model(path)
    ranges = [(w.offset, w.end - w.offset) for w in index.weights.values()]
    return min(o for o, _ in ranges), max(o + n for o, n in ranges), ranges


# -- first touch ----------------------------------------------------------------------------


def fresh(nbytes: int, huge: bool) -> np.ndarray:
    """A fresh, untouched buffer (huge: 2 MiB aligned and MADV_HUGEPAGE)."""
    return aligned_empty(nbytes, HUGE_PAGE_SIZE, populate=False, huge=huge)


def read_into(fd: int, buf: np.ndarray, first: int, last: int, step: Callable[[int], None] | None = None) -> None:
    pos = first
    while pos < last:
        n = min(CHUNK, last - pos)
        if step is not None:
            step(pos - first + n)
        got = os.preadv(fd, [buf[pos - first : pos - first + n].data], pos)
        if got <= 0:
            raise OSError("short read")
        pos += got


def touch_variant(how: str, huge: bool, fadvise: bool | str) -> Callable[[str, int, int], None]:
    def run(path: str, first: int, last: int) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            if fadvise in (True, "willneed", "both"):
                os.posix_fadvise(fd, first, last - first, os.POSIX_FADV_WILLNEED)
            if fadvise in ("sequential", "both"):
                os.posix_fadvise(fd, first, last - first, os.POSIX_FADV_SEQUENTIAL)
            buf = fresh(last - first, huge)
            if how == "populate":
                populate_write(buf)
                read_into(fd, buf, first, last)
            elif how == "on-read":
                read_into(fd, buf, first, last)
            elif how == "background":
                t = threading.Thread(target=populate_write, args=(buf,))
                t.start()
                read_into(fd, buf, first, last)
                t.join()
            elif how == "ahead":
                from service.io.touch import TouchAhead

                with TouchAhead(buf) as ahead:
                    read_into(fd, buf, first, last, ahead.advance)
            else:
                raise ValueError(how)
            del buf
        finally:
            os.close(fd)

    return run


def part_touch(path: str, repeat: int) -> None:
    first, last, _ = data_range(path)
    nbytes = last - first
    hows = ("populate", "on-read", "ahead")
    for cache in CACHES:
        variants: dict[str, Callable[[str, int, int], None]] = {}
        for huge in (False, True):
            for how in hows:
                variants[f"{how:<10} huge={int(huge)}"] = touch_variant(how, huge, False)
        if cache == "cold":
            for huge in (False, True):
                for how in hows[1:]:
                    variants[f"{how:<10} huge={int(huge)} +fadvise"] = touch_variant(how, huge, True)
        report(f"first touch, {cache} cache, {nbytes / MiB:.0f} MiB", variants, repeat, path, first, last, cache)


def part_advice(path: str, repeat: int) -> None:
    """Cold reads into untouched huge-page memory, with and without read-ahead advice
    over the data range given before allocating."""
    first, last, _ = data_range(path)
    variants = {
        f"{how:<10} {advice}": touch_variant(how, True, advice)
        for how in ("on-read", "background")
        for advice in ("none", "willneed", "sequential", "both")
    }
    title = f"read-ahead advice, cold cache, {(last - first) / MiB:.0f} MiB"
    report(title, variants, repeat, path, first, last, "cold")


# -- mmap -------------------------------------------------------------------------------------


def merged(ranges: list[tuple[int, int]], gap: int = HUGE_PAGE_SIZE) -> list[tuple[int, int]]:
    from service.io.readahead import merge_ranges

    return merge_ranges(ranges, gap)


def mmap_variant(how: str) -> Callable[[str, int, int], None]:
    def run(path: str, first: int, last: int) -> None:
        size = os.path.getsize(path)
        fd = os.open(path, os.O_RDONLY)
        ranges = RANGES[path]
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if how == "map-populate" else 0)
            addr = libc.mmap(size, mmap.PROT_READ, flags, fd)
        finally:
            os.close(fd)

        def advise(off: int, n: int, advice: int) -> None:
            lo = off - off % PAGE_SIZE
            libc.madvise(addr + lo, min(off + n - lo, size - lo), advice)

        try:
            if how == "per-tensor":
                for off, n in ranges:
                    advise(off, n, mmap.MADV_WILLNEED)
            elif how in ("merged", "merged-whole"):
                for off, n in merged(ranges):
                    advise(off, n, mmap.MADV_WILLNEED)
            if how in ("per-tensor", "merged", "none"):
                for lo in range(first, last, CHUNK):
                    advise(lo, min(CHUNK, last - lo), MADV_POPULATE_READ)
            elif how == "merged-whole":
                for off, n in merged(ranges):
                    advise(off, n, MADV_POPULATE_READ)
        finally:
            libc.munmap(addr, size)

    return run


RANGES: dict[str, list[tuple[int, int]]] = {}
CACHES = ["warm", "cold"]


def part_mmap(path: str, repeat: int) -> None:
    first, last, ranges = data_range(path)
    RANGES[path] = ranges
    variants = {
        "per-tensor WILLNEED + 16 MiB POPULATE_READ": mmap_variant("per-tensor"),
        "no WILLNEED + 16 MiB POPULATE_READ": mmap_variant("none"),
        "merged WILLNEED + 16 MiB POPULATE_READ": mmap_variant("merged"),
        "merged WILLNEED + one POPULATE_READ": mmap_variant("merged-whole"),
        "MAP_POPULATE": mmap_variant("map-populate"),
    }
    for cache in CACHES:
        report(f"mmap, {cache} cache, {len(ranges)} tensors", variants, repeat, path, first, last, cache)


# -- reuse ------------------------------------------------------------------------------------


def part_reuse(path: str, repeat: int) -> None:
    """A load into a fresh buffer against a load into a buffer a previous load touched."""
    first, last, _ = data_range(path)
    kept: list[np.ndarray] = []

    def reused(path: str, first: int, last: int) -> None:
        if not kept:
            kept.append(fresh(last - first, True))
            populate_write(kept[0])
        fd = os.open(path, os.O_RDONLY)
        try:
            read_into(fd, kept[0], first, last)
        finally:
            os.close(fd)

    variants = {
        "fresh, on-read, huge": touch_variant("on-read", True, False),
        "fresh, on-read, 4k": touch_variant("on-read", False, False),
        "reused (touched) buffer": reused,
    }
    report(f"reuse across loads, warm, {(last - first) / MiB:.0f} MiB", variants, repeat, path, first, last, "warm")


def part_cycle(path: str, repeat: int) -> None:
    """The service's case: load the model, unload it, load it again, in one process, with
    freed host buffers kept for reuse (``HOIST_HOST_BUFFER_CACHE_BYTES``) and without;
    times the second load (host, ``none`` mode, the loader's own path)."""
    import asyncio

    from service.io.buffer_cache import HOST_BUFFER_CACHE
    from service.loader.pipeline import load_model

    first, last, _ = data_range(path)
    index = open_model(path)

    def reload_seconds(cap: int, cache: str) -> float:
        HOST_BUFFER_CACHE.configure(cap, idle_s=0)
        try:
            asyncio.run(load_model(index, load_mode="none")).close()
            if cache == "cold":
                evict(path)
            else:
                warm(path)
            start = time.perf_counter()
            model = asyncio.run(load_model(index, load_mode="none"))
            seconds = time.perf_counter() - start
            model.close()
        finally:
            HOST_BUFFER_CACHE.configure(0)
        return seconds

    variants = {"reload, no cache": 0, "reload, freed buffers kept": 1 << 40}
    for cache in CACHES:
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(repeat):
            for name, cap in variants.items():
                times[name].append(reload_seconds(cap, cache))
        sys.stdout.write(f"\nload -> unload -> load, {cache}, {(last - first) / MiB:.0f} MiB; median of {repeat}\n")
        _rows(times, statistics.median(times["reload, no cache"]), last - first)


# -- driver -----------------------------------------------------------------------------------


def report(
    title: str,
    variants: dict[str, Callable[[str, int, int], None]],
    repeat: int,
    path: str,
    first: int,
    last: int,
    cache: str,
) -> None:
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeat):
        for name, fn in variants.items():
            if cache == "cold":
                evict(path)
            else:
                warm(path)
            start = time.perf_counter()
            fn(path, first, last)
            times[name].append(time.perf_counter() - start)
    sys.stdout.write(f"\n{title}; median of {repeat}, ratio = first variant's time / this one's\n")
    _rows(times, statistics.median(next(iter(times.values()))), last - first)


def _rows(times: dict[str, list[float]], base: float, nbytes: int) -> None:
    """One line per variant: median and range of its times, GB/s of ``nbytes``, and the
    ratio ``base`` / its median."""
    for name, ts in times.items():
        med = statistics.median(ts)
        sys.stdout.write(
            f"  {name:<44} {med * 1000:8.1f} ms  [{min(ts) * 1000:7.1f}-{max(ts) * 1000:7.1f}]"
            f"  {nbytes / med / 1e9:5.2f} GB/s  x{base / med:5.2f}\n"
        )
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--parts", default="touch,mmap,reuse,cycle")
    parser.add_argument("--cache", default="warm,cold")
    args = parser.parse_args()
    CACHES[:] = args.cache.split(",")
    parts = {
        "touch": part_touch,
        "mmap": part_mmap,
        "reuse": part_reuse,
        "advice": part_advice,
        "cycle": part_cycle,
    }
    for name in args.parts.split(","):
        parts[name](args.path, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
