"""The few libc calls Python's standard library does not expose on a raw address range:
``mmap``/``munmap`` of a file we manage by hand, ``madvise``, ``mlock``/``mlock2``/``munlock``."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)

_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64)

_munmap = _libc.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)

_madvise = _libc.madvise
_madvise.restype = ctypes.c_int
_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)

_mlock = _libc.mlock
_mlock.restype = ctypes.c_int
_mlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)

_mlock2 = getattr(_libc, "mlock2", None)
if _mlock2 is not None:
    _mlock2.restype = ctypes.c_int
    _mlock2.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint)

MLOCK_ONFAULT = 1
"""``mlock2`` flag: lock each page of the range when it is first faulted in, not now."""

_munlock = _libc.munlock
_munlock.restype = ctypes.c_int
_munlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)

MAP_FAILED = ctypes.c_void_p(-1).value


def _raise(name: str) -> None:
    err = ctypes.get_errno()
    raise OSError(err, f"{name}: {os.strerror(err)}")


def mmap(length: int, prot: int, flags: int, fd: int, offset: int = 0) -> int:
    """Map ``length`` bytes of ``fd`` from ``offset``; returns the address. Raises OSError."""
    addr = _mmap(None, length, prot, flags, fd, offset)
    if addr is None or addr == MAP_FAILED:
        _raise("mmap")
    return int(addr)


def munmap(addr: int, length: int) -> None:
    """Unmap ``[addr, addr + length)``. Raises OSError."""
    if _munmap(addr, length) != 0:
        _raise("munmap")


def madvise(addr: int, length: int, advice: int) -> None:
    """``madvise`` over ``[addr, addr + length)``. Raises OSError."""
    if _madvise(addr, length, advice) != 0:
        _raise("madvise")


def mlock(addr: int, length: int) -> None:
    """Lock ``[addr, addr + length)`` in memory. Raises OSError (EAGAIN/ENOMEM/EPERM)."""
    if _mlock(addr, length) != 0:
        _raise("mlock")


def mlock_on_fault(addr: int, length: int) -> None:
    """Lock ``[addr, addr + length)`` page by page as the pages are faulted in
    (``mlock2(MLOCK_ONFAULT)``, Linux 4.4+, glibc 2.27+): unlike :func:`mlock`, nothing
    is faulted in now. The lock limit is checked for the whole range at once.

    Raises:
        OSError: as :func:`mlock`; ENOSYS where the C library or kernel lacks ``mlock2``.
    """
    if _mlock2 is None:
        raise OSError(38, "mlock2: not provided by the C library")
    if _mlock2(addr, length, MLOCK_ONFAULT) != 0:
        _raise("mlock2")


def munlock(addr: int, length: int) -> None:
    """Unlock ``[addr, addr + length)``. Raises OSError."""
    if _munlock(addr, length) != 0:
        _raise("munlock")
