"""Reading a file with ``O_DIRECT``, falling back to buffered reads where the filesystem
refuses it (llama.cpp's ``llama_file`` with direct I/O).

Direct reads bypass the page cache; they need the file offset, the length and the
destination address aligned to the filesystem's block size (``st_blksize``). Callers
read aligned supersets of what they need and trim the head and tail.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from typing import Any

import numpy as np

from service.errors import StorageError
from service.io.align import align_down, align_up
from service.io.file import open_readonly, pread_into


class DirectFile:
    """A file open for direct (or, failing that, buffered) positioned reads.

    Args:
        path: the file.
        direct: try ``O_DIRECT``.

    Attributes:
        path: the file.
        size: its size in bytes.
        alignment: required alignment of offsets, lengths and addresses in bytes (1 when
            reads are buffered).
        identity: (device, inode, size, mtime in ns) of the opened file.
        fallback: why direct I/O is not in use although it was asked for, else None.

    Raises (constructor):
        StorageError: the file cannot be opened at all.
    """

    def __init__(self, path: str, *, direct: bool = True) -> None:
        self.path = path
        self.fallback: str | None = None
        self.alignment = 1
        self.fd = -1
        self._buffered_fd = -1
        self._retired: list[int] = []
        self._lock = threading.Lock()
        if direct:
            try:
                self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_DIRECT)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                    raise StorageError(f"cannot open: {exc.strerror}", path=path) from exc
                self.fallback = f"O_DIRECT refused ({exc.strerror}); using buffered reads"
            else:
                st = os.fstat(self.fd)
                if not stat.S_ISREG(st.st_mode):
                    os.close(self.fd)
                    raise StorageError("not a regular file", path=path)
                os.set_blocking(self.fd, True)
                self.alignment = max(st.st_blksize, 512)
        if self.fd < 0:
            self.fd = open_readonly(path)
        st = os.fstat(self.fd)
        self.size = st.st_size
        self.identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    @property
    def direct(self) -> bool:
        """True while reads bypass the page cache."""
        return self.alignment > 1

    @property
    def buffered_fd(self) -> int:
        """A second descriptor of the file, for buffered reads (the page cache) beside
        the direct ones; the direct descriptor itself when reads are buffered anyway.
        Opened on first use, closed with the file.

        Raises:
            StorageError: the file cannot be opened again.
        """
        if not self.direct:
            return self.fd
        with self._lock:
            if self._buffered_fd < 0:
                self._buffered_fd = open_readonly(self.path)
            return self._buffered_fd

    def _to_buffered(self, reason: str) -> None:
        with self._lock:
            if not self.direct:
                return  # another reader switched already
            # the direct descriptor stays open until close(): reads in flight on other
            # threads may still use it
            self._retired.append(self.fd)
            self.fd = self._buffered_fd if self._buffered_fd >= 0 else open_readonly(self.path)
            self._buffered_fd = -1
            self.alignment = 1
            self.fallback = f"{reason}; using buffered reads"

    def read_aligned(self, dest: memoryview, offset: int) -> int:
        """Read ``len(dest)`` bytes at ``offset`` into ``dest`` (all aligned to
        :attr:`alignment` for direct reads). Reading past the end of the file leaves the
        rest of ``dest`` as zeros and returns the bytes that exist.

        A direct read the kernel refuses (EINVAL, EFAULT) switches the file to buffered
        reads (see :attr:`fallback`) and is retried.

        Raises:
            StorageError: a read failed.
        """
        total = len(dest)
        done = 0
        while done < total:
            try:
                n = os.preadv(self.fd, [dest[done:]], offset + done)
            except InterruptedError:
                continue
            except OSError as exc:
                if self.direct and exc.errno in (errno.EINVAL, errno.EFAULT):
                    self._to_buffered(f"direct read refused ({exc.strerror})")
                    continue
                raise StorageError(f"read failed: {exc.strerror}", path=self.path, offset=offset + done) from exc
            if n == 0:
                dest[done:] = bytes(total - done)
                return done
            done += n
        return done

    def read_into(self, dest: memoryview, offset: int, bounce: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
        """Fill ``dest`` (any address and length) with the bytes at ``offset``: buffered
        straight into ``dest``, or direct through ``bounce`` (an aligned buffer whose size
        is a multiple of :attr:`alignment`, at least two alignments) with the head and
        tail trimmed.

        Raises:
            StorageError: a read failed or the file ended first.
        """
        if not self.direct:
            pread_into(self.fd, dest, offset, path=self.path)
            return
        a = self.alignment
        step = align_down(len(bounce), a) - a
        done = 0
        total = len(dest)
        while done < total:
            if not self.direct:
                pread_into(self.fd, dest[done:], offset + done, path=self.path)
                return
            start = offset + done
            read_from = align_down(start, a)
            head = start - read_from
            n = min(step, total - done)
            read_len = align_up(head + n, a)
            got = self.read_aligned(bounce[:read_len].data, read_from)
            if got < head + n:
                raise StorageError(
                    f"unexpected end of file: {head + n - got} bytes missing", path=self.path, offset=start + got
                )
            dest[done : done + n] = bounce[head : head + n].data
            done += n

    def read_buffered(self, dest: memoryview, offset: int, *, tensor: str | None = None) -> None:
        """Fill ``dest`` with the bytes at ``offset`` through the page cache (beside the
        direct reads, see :attr:`buffered_fd`).

        Raises:
            StorageError: a read failed or the file ended first.
        """
        pread_into(self.buffered_fd, dest, offset, path=self.path, tensor=tensor)

    def close(self) -> None:
        """Close the file. Idempotent."""
        if self._buffered_fd >= 0:
            os.close(self._buffered_fd)
            self._buffered_fd = -1
        while self._retired:
            os.close(self._retired.pop())
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
