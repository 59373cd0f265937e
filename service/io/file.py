"""Opening model files and positioned reads that never return short."""

from __future__ import annotations

import os
import stat

from service.errors import RequestError, StorageError


def open_readonly(path: str) -> int:
    """Open the regular file ``path`` for reading; returns the file descriptor.

    The file is opened non-blocking, so a FIFO or device node cannot stall the open, and
    refused unless it is a regular file.

    Raises:
        StorageError: the file cannot be opened or is not a regular file (the message
            gives the reason).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise StorageError(f"cannot open: {exc.strerror}", path=path) from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise StorageError("not a regular file", path=path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_inside(fd: int, root: str, path: str) -> None:
    """Raise unless the file open as ``fd`` lies inside the directory ``root`` (as the
    kernel resolved it when opening: a symbolic link swapped between a check of the path
    and the open cannot lead outside).

    Raises:
        RequestError: the opened file is outside ``root``.
    """
    real_root = os.path.realpath(root)
    try:
        opened = os.readlink(f"/proc/self/fd/{fd}")
    except OSError as exc:
        raise StorageError(f"cannot tell where the opened file lies: {exc.strerror}", path=path) from exc
    if not opened.startswith("/") or os.path.commonpath([real_root, opened]) != real_root:
        raise RequestError(f"'{path}' resolves outside the models directory", path=path)


def pread_into(fd: int, dest: memoryview, offset: int, *, path: str, tensor: str | None = None) -> None:
    """Fill ``dest`` with the file's bytes from ``offset``, retrying short reads.

    Raises:
        StorageError: a read failed, or the file ended before ``dest`` was full (naming
            ``tensor`` when given).
    """
    done = 0
    total = len(dest)
    while done < total:
        try:
            n = os.preadv(fd, [dest[done:]], offset + done)
        except InterruptedError:
            continue
        except OSError as exc:
            raise StorageError(f"read failed: {exc.strerror}", path=path, offset=offset + done, tensor=tensor) from exc
        if n == 0:
            what = f" in the data of tensor '{tensor}'" if tensor else ""
            raise StorageError(
                f"unexpected end of file{what}: {total - done} of {total} bytes missing (did the file shrink?)",
                path=path,
                offset=offset + done,
                tensor=tensor,
            )
        done += n
