"""Opening model files and positioned reads that never return short."""

from __future__ import annotations

import os

from service.errors import StorageError


def open_readonly(path: str) -> int:
    """Open ``path`` for reading; returns the file descriptor.

    Raises:
        StorageError: the file cannot be opened (the message gives the OS reason).
    """
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise StorageError(f"cannot open: {exc.strerror}", path=path) from exc


def pread_into(fd: int, dest: memoryview, offset: int, *, path: str) -> None:
    """Fill ``dest`` with the file's bytes from ``offset``, retrying short reads.

    Raises:
        StorageError: a read failed, or the file ended before ``dest`` was full.
    """
    done = 0
    total = len(dest)
    while done < total:
        try:
            n = os.preadv(fd, [dest[done:]], offset + done)
        except InterruptedError:
            continue
        except OSError as exc:
            raise StorageError(f"read failed: {exc.strerror}", path=path, offset=offset + done) from exc
        if n == 0:
            raise StorageError(
                f"unexpected end of file: {total - done} of {total} bytes missing",
                path=path,
                offset=offset + done,
            )
        done += n
