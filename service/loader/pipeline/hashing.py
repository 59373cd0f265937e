"""The hashers (hash-tensors): an xxh3_64 digest of every tensor's bytes, computed on one
thread while reading goes on.

Each tensor has a streaming xxh3_64 state fed in file order: the loader queues the
updates in load order (its ``complete`` step) to a single thread, so they run in the
order queued and off the loader thread. The bytes are hashed where they arrive: a host
buffer once the extent is in place, a staging buffer before it is reused (the caller
records the returned future on the buffer), a temporary buffer of a synchronous upload.
A tensor that lies in a file mapping (or is copied from it) is hashed by reading its
bytes with ``pread``, never through the mapping: a file that shrinks meanwhile then
gives an error, never SIGBUS.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import xxhash

from service.loader.pipeline.layout import TensorJob, pread_tensor
from service.loader.pipeline.stats import StageClock

ALGORITHM = "xxh3_64"
"""The digest the hashers compute (``xxhash.xxh3_64``, hex, 16 digits)."""


class Hashers:
    """Queued hash updates of one load and the digests they give.

    Args:
        enabled: hash-tensors is on (else nothing is queued).
        chunk_nbytes: bytes read at a time when hashing a tensor from its file.
        clock: the hash stage's clock.

    Attributes:
        digests: tensor name -> hex xxh3_64 digest of its bytes, for every tensor whose
            bytes were all hashed (filled by :meth:`collect`).
    """

    def __init__(self, *, enabled: bool, chunk_nbytes: int, clock: StageClock) -> None:
        self.enabled = enabled
        self.chunk_nbytes = chunk_nbytes
        self.clock = clock
        self.digests: dict[str, str] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._tasks: list[Future[None]] = []
        # job index -> (name, nbytes, state, bytes hashed so far); touched by the hash thread only
        self._states: dict[int, tuple[str, int, Any, int]] = {}
        self._skip: set[int] = set()

    def skip(self, job: TensorJob) -> None:
        """Do not hash ``job`` (a second copy of a tensor hashed elsewhere)."""
        self._skip.add(job.index)

    def _submit(self, update: Any) -> Future[None]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="hoist-hash")
        future = self._pool.submit(update)
        self._tasks.append(future)
        return future

    def _feed(self, job: TensorJob, data: Any) -> None:
        """Add ``data`` to ``job``'s state (hash thread)."""
        entry = self._states.get(job.index)
        if entry is None:
            entry = (job.name, job.nbytes, xxhash.xxh3_64(), 0)
        name, nbytes, state, done = entry
        with self.clock.busy(len(data)):
            state.update(data)
        self._states[job.index] = (name, nbytes, state, done + len(data))

    def array(self, job: TensorJob, data: Any) -> Future[None] | None:
        """Queue an update of ``job``'s state with ``data`` (the host bytes that follow
        those queued before for it); None without hash-tensors, for a skipped tensor, or
        for device memory (which is never handed here)."""
        if not self.enabled or job.index in self._skip or not isinstance(data, np.ndarray):
            return None
        return self._submit(lambda: self._feed(job, data))

    def file(self, job: TensorJob, fd: int) -> None:
        """Queue hashing all of ``job``'s bytes, read from ``fd`` (its file) with ``pread``."""
        if not self.enabled or job.index in self._skip:
            return
        step = max(1, self.chunk_nbytes)

        def update() -> None:
            for start in range(0, job.nbytes, step):
                n = min(step, job.nbytes - start)
                self._feed(job, pread_tensor(job, fd, start, n))
            if job.nbytes == 0:
                self._feed(job, b"")

        self._submit(update)

    def collect(self) -> list[BaseException]:
        """Wait for every update; fill :attr:`digests` and return the errors raised."""
        errors: list[BaseException] = []
        for future in self._tasks:
            if future.cancelled():
                continue
            try:
                future.result()
            except BaseException as exc:
                errors.append(exc)
        self._tasks.clear()
        for name, nbytes, state, done in self._states.values():
            if done == nbytes:
                self.digests[name] = state.hexdigest()
        self._states.clear()
        return errors

    def close(self, *, cancel: bool) -> None:
        """Stop the thread (dropping queued updates when ``cancel``), after the running
        one finishes. Idempotent."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=cancel)
            self._pool = None
        self._tasks.clear()
