"""The validators (check-tensors): NaN/Inf in values and block scales, checked on a pool
of threads while reading goes on.

Data in host memory (a host buffer, a staging buffer) is checked where it lies; a tensor
that lies in a file mapping is checked by reading its bytes with ``pread``, never through
the mapping: a file that shrinks meanwhile then gives an error, never SIGBUS.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from service.loader.ggml_types import GGML_TYPES_BY_NAME
from service.loader.pipeline.layout import TensorJob, pread_tensor
from service.loader.pipeline.stats import StageClock
from service.loader.validate import InvalidData, validate_row_data


class Validators:
    """Queued validations of one load and their findings.

    Args:
        enabled: check-tensors is on (else nothing is queued).
        workers: threads checking in parallel.
        chunk_nbytes: bytes read at a time when checking a mapped tensor.
        clock: the validate stage's clock.

    Attributes:
        invalid: tensor name -> the first problem found in it.
    """

    def __init__(self, *, enabled: bool, workers: int, chunk_nbytes: int, clock: StageClock) -> None:
        self.enabled = enabled
        self.workers = workers
        self.chunk_nbytes = chunk_nbytes
        self.clock = clock
        self.invalid: dict[str, InvalidData] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._checks: list[tuple[str, Future[InvalidData | None]]] = []

    def _submit(self, name: str, check: Any) -> Future[InvalidData | None]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="hoist-validate")
        future = self._pool.submit(check)
        self._checks.append((name, future))
        return future

    def array(self, job: TensorJob, data: Any, base: int = 0) -> Future[InvalidData | None] | None:
        """Queue a check of ``data`` (host bytes of ``job`` from its byte ``base``, whole
        blocks); None without check-tensors or for device memory."""
        if not self.enabled or not isinstance(data, np.ndarray):
            return None

        def check() -> InvalidData | None:
            with self.clock.busy(len(data)):
                found = validate_row_data(job.ggml_type, data)
            return None if found is None else InvalidData(found.reason, found.offset + base)

        return self._submit(job.name, check)

    def now(self, job: TensorJob, data: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
        """Check ``data`` (all of ``job``'s bytes) on this thread."""
        if not self.enabled:
            return
        with self.clock.busy(len(data)):
            found = validate_row_data(job.ggml_type, data)
        if found is not None:
            self.invalid.setdefault(job.name, found)

    def file(self, job: TensorJob, fd: int) -> None:
        """Queue a check of ``job``'s bytes read from ``fd`` (its file) with ``pread``."""
        if not self.enabled:
            return
        type_size = GGML_TYPES_BY_NAME[job.ggml_type].type_size
        step = max(1, self.chunk_nbytes // type_size) * type_size

        def check() -> InvalidData | None:
            for start in range(0, job.nbytes, step):
                n = min(step, job.nbytes - start)
                with self.clock.busy(n):
                    found = validate_row_data(job.ggml_type, pread_tensor(job, fd, start, n))
                if found is not None:
                    return InvalidData(found.reason, found.offset + start)
            return None

        self._submit(job.name, check)

    def collect(self) -> list[BaseException]:
        """Wait for every check; record what they found in :attr:`invalid` and return
        the errors they raised."""
        errors: list[BaseException] = []
        for name, future in self._checks:
            if future.cancelled():
                continue
            try:
                found = future.result()
            except BaseException as exc:
                errors.append(exc)
                continue
            if found is not None and name not in self.invalid:
                self.invalid[name] = found
        self._checks.clear()
        return errors

    def close(self, *, cancel: bool) -> None:
        """Stop the threads (dropping queued checks when ``cancel``), after the running
        ones finish. Idempotent."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=cancel)
            self._pool = None
