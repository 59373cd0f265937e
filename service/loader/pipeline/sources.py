"""The files a load reads, and the reads themselves: positioned reads (never through a
mapping, so that a file that shrinks gives an error instead of SIGBUS), with direct I/O
routed by the page cache (see :mod:`.routing`), counting the bytes that came from the
page cache and from disk."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from service.errors import StorageError
from service.io import residency
from service.io.align import PAGE_SIZE, align_down, align_up, aligned_empty
from service.io.direct import DirectFile
from service.io.file import open_readonly
from service.loader.pipeline.layout import TensorJob, check_identity
from service.loader.pipeline.routing import Segment, route
from service.loader.pipeline.stats import WorkerStats

BOUNCE_NBYTES = 4 << 20
"""Payload of the per-thread buffer that direct reads into unaligned memory go through."""

PROBE_STEP = 1 << 30
"""Bytes of a file probed for residency at once."""

Identity = tuple[int, int, int, int]


class SourceFiles:
    """The load's open model files (direct or buffered) and the descriptors validation
    reads mapped tensors through; every file checked to be the one whose header was
    parsed.

    Args:
        direct: open for direct I/O.
        identities: file index -> identity when its header was parsed.
        stats: where bytes from cache and disk are counted.
    """

    def __init__(self, *, direct: bool, identities: dict[int, Identity], stats: WorkerStats) -> None:
        self.direct = direct
        self.identities = identities
        self.stats = stats
        self.files: dict[int, DirectFile] = {}
        self._check_fds: dict[int, int] = {}
        self._trusted: dict[int, bool] = {}
        self._bounces: dict[int, np.ndarray[Any, np.dtype[np.uint8]]] = {}
        self._lock = threading.Lock()
        self._before: dict[int, residency.ResidencyMap] = {}

    def open(self, job: TensorJob) -> DirectFile:
        """The file of ``job``, opened on first use (on the coordinating thread).

        Raises:
            StorageError: it cannot be opened, or it is not the file that was parsed.
        """
        f = self.files.get(job.file_index)
        if f is None:
            f = DirectFile(job.path, direct=self.direct)
            self.files[job.file_index] = f
            check_identity(job.path, self.identities.get(job.file_index, (0, 0, 0, 0)), f.identity)
        return f

    def alignments(self) -> dict[int, int]:
        """File index -> the alignment its direct reads need (1: buffered)."""
        return {i: f.alignment for i, f in self.files.items()}

    def check_fd(self, job: TensorJob) -> int:
        """A buffered descriptor for validation reads of ``job``'s file (on the
        coordinating thread).

        Raises:
            StorageError: it cannot be opened, or it is not the file that was parsed.
        """
        fd = self._check_fds.get(job.file_index)
        if fd is None:
            fd = self._check_fds[job.file_index] = open_readonly(job.path)
            st = os.fstat(fd)
            opened = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            check_identity(job.path, self.identities.get(job.file_index, (0, 0, 0, 0)), opened)
        return fd

    def take_residency(self, file_index: int, path: str, lo: int, hi: int) -> None:
        """Note which pages of ``[lo, hi)`` of the file are in the page cache now, before
        the load reads them (its own reads and read-ahead bring more in): the bytes
        counted as from the cache are those resident here. Nothing is noted when the
        kernel does not tell (the bytes are then counted as unprobed).

        Raises:
            StorageError: the file cannot be opened.
        """
        if hi <= lo:
            return
        fd = open_readonly(path)
        try:
            if not residency.trusted(fd):
                return
            first, npages, cached = residency.cached_span(fd, lo, hi)
            if cached is not None and cached in (0, npages):
                # all of it resident, or none: no per-page answer needed
                self._before[file_index] = residency.ResidencyMap.all_or_none(
                    first // PAGE_SIZE, npages, cached == npages
                )
                return
            parts = []
            for start in range(first, hi, PROBE_STEP):
                end = min(start + PROBE_STEP, hi)
                parts.append(residency.resident_pages(fd, start, end - start))
        except (OSError, ValueError):
            return
        finally:
            os.close(fd)
        self._before[file_index] = residency.ResidencyMap(first // PAGE_SIZE, np.concatenate(parts))

    def note_resident(self, file_index: int, lo: int, hi: int) -> None:
        """Note ``[lo, hi)`` of the file as wholly in the page cache, as a probe made just
        before found it (:meth:`take_residency` without probing again)."""
        first, npages = residency.page_span(lo, hi)
        self._before[file_index] = residency.ResidencyMap.all_or_none(first // PAGE_SIZE, npages, True)

    def wholly_resident(self, file_index: int) -> bool:
        """Every page :meth:`take_residency` probed for the file was in the page cache."""
        before = self._before.get(file_index)
        return before is not None and before.all_resident

    def count(self, file_index: int, parts: Sequence[tuple[int, int]], *, buffered: bool) -> None:
        """Count the ``[lo, hi)`` ranges ``parts`` of the file as read: from the cache for
        the pages that were resident before the load when read ``buffered`` (or faulted
        in), else from disk."""
        before = self._before.get(file_index) if buffered else None
        cache = disk = unprobed = 0
        if before is not None and before.uniform and parts:
            # all resident: every byte inside the pages probed came from the cache
            start, end = before.first * PAGE_SIZE, (before.first + before.npages) * PAGE_SIZE
            if start <= min(lo for lo, _ in parts) and max(hi for _, hi in parts) <= end:
                n = sum(hi - lo for lo, hi in parts if hi > lo)
                if n:
                    self.stats.count_source(n, 0, 0)
                return
        for lo, hi in parts:
            if hi <= lo:
                continue
            if not buffered:
                disk += hi - lo
            elif before is None:
                unprobed += hi - lo
            else:
                resident = before.resident_bytes(lo, hi)
                cache += resident
                disk += hi - lo - resident
        if cache or disk or unprobed:
            self.stats.count_source(cache, disk, unprobed)

    def _count_parts(
        self, file_index: int, parts: Sequence[tuple[int, int]] | None, lo: int, hi: int, *, buffered: bool
    ) -> None:
        self.count(
            file_index,
            [(max(a, lo), min(b, hi)) for a, b in parts] if parts is not None else [(lo, hi)],
            buffered=buffered,
        )

    # -- reads (on reader threads) --------------------------------------------------------

    def _pages(self, file_index: int, f: DirectFile, lo: int, hi: int) -> np.ndarray[Any, Any] | None:
        """Residency of the pages of ``[lo, hi)``, or None when it cannot be told."""
        trusted = self._trusted.get(file_index)
        if trusted is None:
            trusted = self._trusted[file_index] = residency.trusted(f.buffered_fd)
        if not trusted:
            return None
        try:
            return residency.resident_pages(f.buffered_fd, lo, hi - lo)
        except (OSError, ValueError):
            return None

    def bounce(self, nbytes: int, alignment: int = 4096) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """This thread's scratch buffer, at least ``nbytes`` long (reused by its reads)."""
        key = threading.get_ident()
        buf = self._bounces.get(key)
        if buf is None or len(buf) < nbytes:
            buf = aligned_empty(max(nbytes, 4096), max(alignment, 4096))
            with self._lock:
                self._bounces[key] = buf
        return buf

    def read(
        self,
        job: TensorJob,
        target: np.ndarray[Any, Any],
        base: int,
        lo: int,
        hi: int,
        *,
        aligned: bool,
        counted: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        """Read file bytes ``[lo, hi)`` of ``job``'s file into ``target``, whose element
        ``i`` holds file byte ``base + i``.

        With direct I/O, pages in the page cache are read buffered and the rest with
        ``O_DIRECT``: whole blocks straight into ``target`` when ``aligned`` (``target``
        and ``base`` aligned to the file's block size, ``target`` covering the blocks of
        ``[lo, hi)``), else through this thread's bounce buffer. The tensor bytes in
        ``counted`` (file ranges; default all of ``[lo, hi)``) are counted as from the
        cache or from disk.

        Raises:
            StorageError: a read failed or the file ended first (naming the tensor).
        """
        if hi <= lo:
            return
        f = self.files[job.file_index]
        a = f.alignment
        r_lo, r_hi = (align_down(lo, a), align_up(hi, a)) if f.direct else (lo, hi)
        if not f.direct:
            self._count_parts(job.file_index, counted, lo, hi, buffered=True)
            f.read_buffered(target[lo - base : hi - base].data, lo, tensor=job.name)
            return
        pages = self._pages(job.file_index, f, r_lo, r_hi)
        segments = route(pages, r_lo, r_hi, a) if pages is not None else [Segment(r_lo, r_hi, False)]
        for seg in segments:
            p_lo, p_hi = max(seg.lo, lo), min(seg.hi, hi)
            self._count_parts(job.file_index, counted, p_lo, p_hi, buffered=seg.buffered)
            if seg.buffered:
                f.read_buffered(target[p_lo - base : p_hi - base].data, p_lo, tensor=job.name)
            elif aligned and f.direct:
                got = f.read_aligned(target[seg.lo - base : seg.hi - base].data, seg.lo)
                if got < p_hi - seg.lo:
                    raise StorageError(
                        f"unexpected end of file in the data of tensor '{job.name}'",
                        path=f.path,
                        offset=seg.lo + got,
                        tensor=job.name,
                    )
            else:
                bounce = self.bounce(BOUNCE_NBYTES + 2 * a, a) if f.direct else np.empty(0, dtype=np.uint8)
                try:
                    f.read_into(target[p_lo - base : p_hi - base].data, p_lo, bounce)
                except StorageError as exc:
                    raise StorageError(exc.message, path=exc.path, offset=exc.offset, tensor=job.name) from exc

    # -- the end --------------------------------------------------------------------------

    def changed(self) -> list[StorageError]:
        """A file read from that changed (size or modification time) since it was opened:
        bytes read before and after the change may not belong together."""
        out = []
        for f in self.files.values():
            try:
                st = os.fstat(f.fd)
            except OSError as exc:
                out.append(StorageError(f"cannot check the file after reading it: {exc.strerror}", path=f.path))
                continue
            if (st.st_size, st.st_mtime_ns) != (f.identity[2], f.identity[3]):
                out.append(
                    StorageError(
                        f"the file changed while it was read ({f.identity[2]} bytes then, {st.st_size} now)",
                        path=f.path,
                    )
                )
        return out

    def close(self) -> None:
        """Close every descriptor and drop the bounce buffers; note which files were
        read with direct I/O and why others were not. Idempotent."""
        for fd in self._check_fds.values():
            os.close(fd)
        self._check_fds.clear()
        for f in self.files.values():
            if self.direct and f.direct:
                self.stats.direct_io.append(f.path)
            elif self.direct and f.fallback:
                self.stats.notices.append(f"direct I/O unavailable for {f.path}: {f.fallback}")
            f.close()
        self.files.clear()
        self._bounces.clear()
