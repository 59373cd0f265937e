"""A read-only shared mapping of a whole model file (llama.cpp's ``llama_mmap``).

The mapping is made with libc directly rather than Python's ``mmap`` so that parts of it
can be unmapped after a load (``unmap_fragment``) while the rest stays in use: Python's
``mmap`` object would unmap its whole original range when closed, including address
space the process may have reused since.

SAFETY: arrays returned by :meth:`Mapping.array` point into the mapping; they are valid
until the range they cover is unmapped or the mapping is closed. Owners (a loaded model)
drop their arrays before closing.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap as _mmap_mod
import os
import threading
from collections.abc import Sequence

import numpy as np

from service.errors import StorageError
from service.io import libc
from service.io.align import PAGE_SIZE, align_down, align_up
from service.io.file import open_readonly, pread_into

MADV_POPULATE_READ = 22
"""Linux 5.14+: fault in a range's pages, synchronously, without copying them."""


def _probe_populate_read() -> bool:
    """Whether this kernel knows ``MADV_POPULATE_READ`` (tried on an anonymous page)."""
    page = _mmap_mod.mmap(-1, PAGE_SIZE)
    try:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(page))
        libc.madvise(addr, PAGE_SIZE, MADV_POPULATE_READ)
        return True
    except OSError:
        return False
    finally:
        try:
            page.close()
        except BufferError:
            pass


POPULATE_READ_SUPPORTED = _probe_populate_read()

AHEAD_STEP = 4 << 30
"""Bytes faulted in ahead per call: a stop asked for is seen within one such call (4 GiB
of resident pages: a few ms where the page cache holds the file in large folios, as
buffered reads leave it, up to about 300 ms in 4 KiB pages). Fewer calls matter more:
between two of them the thread needs the interpreter, which the load holds, and may
wait up to a switch interval (5 ms)."""


class _Ahead:
    """Ranges of a mapping being faulted in on a thread of its own (see
    :meth:`Mapping.populate_ahead`)."""

    def __init__(
        self, mapping: Mapping, ranges: Sequence[tuple[int, int]], cancel: threading.Event | None = None
    ) -> None:
        self.starts = [lo for lo, _ in ranges]
        self.ends = [lo + n for lo, n in ranges]
        self.ok = False
        self.done = False
        self.stop = threading.Event()
        self._cancel = cancel
        self._mapping = mapping
        self._ranges = ranges
        self._thread = threading.Thread(target=self._run, name="hoist-populate", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for offset, nbytes in self._ranges:
            for lo in range(offset, offset + nbytes, AHEAD_STEP):
                if self.stop.is_set() or (self._cancel is not None and self._cancel.is_set()):
                    return
                try:
                    self._mapping.populate(lo, min(AHEAD_STEP, offset + nbytes - lo), ahead=False)
                except StorageError:
                    return  # the load's own populate of the range meets the error and reports it
        self.ok = True

    def wait(self) -> None:
        """Wait until the thread ends (every range came in, or it stopped)."""
        if not self.done:
            self._thread.join()
            self.done = True

    def covers(self, offset: int, nbytes: int) -> bool:
        """Wait until the ranges are in; whether they all came in and one of them holds
        ``[offset, offset + nbytes)``."""
        self.wait()
        i = bisect.bisect_right(self.starts, offset) - 1
        return self.ok and i >= 0 and offset + nbytes <= self.ends[i]

    def close(self) -> None:
        """Stop after the call in progress and wait for the thread."""
        self.stop.set()
        self._thread.join()


def subtract_fragment(fragments: list[tuple[int, int]], first: int, last: int) -> list[tuple[int, int]]:
    """``fragments`` (disjoint ``[start, end)`` ranges) minus ``[first, last)``.

    A fragment that contains the removed range is split in two; fragments that overlap
    one side are trimmed; fragments inside it are dropped.
    """
    out: list[tuple[int, int]] = []
    for start, end in fragments:
        if end <= first or start >= last:
            out.append((start, end))
            continue
        if start < first:
            out.append((start, first))
        if end > last:
            out.append((last, end))
    return out


class Mapping:
    """A read-only ``MAP_SHARED`` mapping of a whole file.

    Attributes:
        path: the mapped file.
        size: the file's size in bytes (the mapping's length).
        identity: (device, inode, size, mtime in ns) of the file that was mapped.
        addr: the start address of the mapping.
        fragments: the still-mapped ``[start, end)`` byte ranges, page-aligned except at
            the end of the file.

    Raises (constructor):
        StorageError: the file cannot be opened or mapped.
    """

    def __init__(self, path: str, *, sequential: bool = True, fd: int | None = None) -> None:
        """Map ``path``; ``fd``: the file already open as this descriptor (it stays open,
        the caller's to close), instead of opening ``path`` again."""
        self.path = path
        own = fd is None
        if fd is None:
            fd = open_readonly(path)
        try:
            st = os.fstat(fd)
            self.size = st.st_size
            self.identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            if self.size == 0:
                raise StorageError("cannot map an empty file", path=path)
            if sequential:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            try:
                self.addr = libc.mmap(self.size, _mmap_mod.PROT_READ, _mmap_mod.MAP_SHARED, fd)
            except OSError as exc:
                raise StorageError(f"cannot map the file: {exc.strerror}", path=path) from exc
        finally:
            if own:
                os.close(fd)
        self.fragments: list[tuple[int, int]] = [(0, self.size)]
        self._lock = threading.Lock()
        self._ahead: _Ahead | None = None
        self._whole: np.ndarray[tuple[int], np.dtype[np.uint8]] | None = None

    def changed(self) -> str | None:
        """How the mapped file changed since it was mapped (size or modification time),
        or None while it is unchanged or nothing is mapped any more. A mapped file that
        shrinks turns reads of the pages past its new end into SIGBUS; one rewritten in
        place changes what the mapped tensors hold.

        The file is found by its path (no descriptor is kept open for it): when the path
        names another file now (replaced, or deleted), the mapping keeps the original,
        which nothing can truncate through that path any more, and None is returned.
        """
        if not self.fragments:
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        if (st.st_dev, st.st_ino) != self.identity[:2]:
            return None
        if st.st_size != self.identity[2]:
            return f"its size changed from {self.identity[2]} to {st.st_size} bytes"
        if st.st_mtime_ns != self.identity[3]:
            return "it was modified"
        return None

    @property
    def closed(self) -> bool:
        """True once every fragment is unmapped."""
        return not self.fragments

    @property
    def mapped_nbytes(self) -> int:
        """Bytes still mapped."""
        return sum(end - start for start, end in self.fragments)

    def _check_mapped(self, offset: int, nbytes: int) -> None:
        end = offset + nbytes
        if offset < 0 or end > self.size:
            raise StorageError(f"range [{offset}, {end}) is outside the mapping", path=self.path, offset=offset)
        if nbytes:
            for start, stop in self.fragments:
                if start <= offset and end <= stop:
                    return
            raise StorageError(f"range [{offset}, {end}) is no longer mapped", path=self.path, offset=offset)

    def array(self, offset: int, nbytes: int) -> np.ndarray[tuple[int], np.dtype[np.uint8]]:
        """A read-only ``uint8`` view of ``nbytes`` bytes at file ``offset`` (zero copy).

        Raises:
            StorageError: the range is outside the file or no longer mapped.
        """
        self._check_mapped(offset, nbytes)
        if nbytes == 0:
            return np.empty(0, dtype=np.uint8)
        whole = self._whole
        if whole is None:
            buf = (ctypes.c_ubyte * self.size).from_address(self.addr)
            whole = self._whole = np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
            whole.flags.writeable = False
        return whole[offset : offset + nbytes]

    def advise(self, offset: int, nbytes: int, advice: int) -> None:
        """``madvise`` the pages covering ``[offset, offset + nbytes)`` (outward to pages).

        Raises:
            OSError: the kernel refused the advice (e.g. EINVAL for an unknown advice).
        """
        if nbytes <= 0:
            return
        first = align_down(offset, PAGE_SIZE)
        last = min(align_up(offset + nbytes, PAGE_SIZE), align_up(self.size, PAGE_SIZE))
        libc.madvise(self.addr + first, last - first, advice)

    def populate_ahead(self, ranges: Sequence[tuple[int, int]], cancel: threading.Event | None = None) -> None:
        """Start faulting in ``ranges`` (``(offset, nbytes)``, disjoint, in file order) on
        a thread of its own, while the caller goes on (llama.cpp maps with
        ``MAP_POPULATE``; here the faulting overlaps the work that follows the mapping).
        A later :meth:`populate` of bytes inside one of the ranges waits for the thread
        and returns at once when every range came in; otherwise (an error, a stop) it
        faults its range in itself and raises what it meets. :meth:`close`, or
        ``cancel`` once set, stops the thread after the call in progress; :meth:`close`
        waits for it before unmapping. One run per mapping: a second call does
        nothing."""
        if self._ahead is None and ranges:
            self._ahead = _Ahead(self, list(ranges), cancel)

    def wait_ahead(self) -> None:
        """Wait until the thread :meth:`populate_ahead` started ends (nothing when there
        is none)."""
        if self._ahead is not None:
            self._ahead.wait()

    @property
    def populating_ahead(self) -> bool:
        """:meth:`populate_ahead` was called (its thread may have finished)."""
        return self._ahead is not None

    def populate(self, offset: int, nbytes: int, *, ahead: bool = True) -> None:
        """Fault in ``[offset, offset + nbytes)`` now, reading it from disk if needed
        (nothing when :meth:`populate_ahead` already brought the range in; ``ahead``
        False: do not look at that).

        Uses ``MADV_POPULATE_READ`` (Linux 5.14+), which fails cleanly where touching the
        pages would raise SIGBUS (a file that shrank while mapped). Older kernels get
        ``MADV_WILLNEED`` and a positioned read of the range, which brings the same pages
        into the page cache and cannot fault.

        Raises:
            StorageError: the bytes cannot be read (the file shrank or changed while mapped,
                or an I/O error).
        """
        self._check_mapped(offset, nbytes)
        if nbytes <= 0:
            return
        if ahead and self._ahead is not None and self._ahead.covers(offset, nbytes):
            return
        if POPULATE_READ_SUPPORTED:
            try:
                self.advise(offset, nbytes, MADV_POPULATE_READ)
            except OSError as exc:
                raise StorageError(
                    f"cannot read mapped bytes [{offset}, {offset + nbytes}): {os.strerror(exc.errno or 0)}"
                    " (did the file shrink or change while mapped?)",
                    path=self.path,
                    offset=offset,
                ) from exc
            return
        self.advise(offset, nbytes, _mmap_mod.MADV_WILLNEED)
        fd = open_readonly(self.path)
        try:
            scratch = bytearray(min(nbytes, 1 << 20))
            done = 0
            while done < nbytes:
                view = memoryview(scratch)[: min(len(scratch), nbytes - done)]
                pread_into(fd, view, offset + done, path=self.path)
                done += len(view)
        finally:
            os.close(fd)

    def unmap_fragment(self, first: int, last: int) -> None:
        """Unmap the whole pages inside ``[first, last)`` (llama.cpp ``unmap_fragment``).

        The range is aligned inward to page boundaries, so a page shared with bytes
        outside the range stays mapped; ``fragments`` is updated so later calls and
        :meth:`close` unmap exactly what is still mapped.
        """
        first = align_up(first, PAGE_SIZE)
        last = align_down(last, PAGE_SIZE) if last < self.size else align_up(self.size, PAGE_SIZE)
        if last <= first:
            return
        if self._ahead is not None:
            self._ahead.close()
        with self._lock:
            for start, end in self.fragments:
                lo, hi = max(start, first), min(align_up(end, PAGE_SIZE), last)
                if hi > lo:
                    libc.munmap(self.addr + lo, hi - lo)
            self.fragments = subtract_fragment(self.fragments, first, last)

    def close(self) -> None:
        """Stop faulting in ahead, then unmap everything still mapped. Idempotent."""
        if self._ahead is not None:
            self._ahead.close()
        with self._lock:
            for start, end in self.fragments:
                libc.munmap(self.addr + start, align_up(end, PAGE_SIZE) - start)
            self.fragments = []
            self._whole = None

    def __enter__(self) -> Mapping:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
