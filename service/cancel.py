"""Stopping blocking work early: a token that work running on a thread checks at its
loop heads, set by its owner (a client that went away) or by a deadline."""

from __future__ import annotations

import threading
import time

from service.errors import RequestAbandonedError, WorkLimitError


class CancelToken:
    """Tells long-running work (header parsing, planning, override matching) to stop.

    Args:
        deadline_s: seconds from now after which :meth:`check` raises; None for no limit.
        what: what the work is, for messages (``reading the header``).

    The work calls :meth:`check` at its loop heads; the owner calls :meth:`cancel`.
    """

    def __init__(self, deadline_s: float | None = None, what: str = "the request") -> None:
        self.what = what
        self.limit_s = deadline_s
        self._deadline = None if deadline_s is None else time.monotonic() + deadline_s
        self._event = threading.Event()
        self._reason = ""

    def arm(self, deadline_s: float | None) -> None:
        """Start (or restart) the time limit: ``deadline_s`` seconds from now."""
        self.limit_s = deadline_s
        self._deadline = None if deadline_s is None else time.monotonic() + deadline_s

    @property
    def cancelled(self) -> bool:
        """True once :meth:`cancel` was called."""
        return self._event.is_set()

    def cancel(self, reason: str = "the client went away") -> None:
        """Ask the work to stop at its next check."""
        self._reason = reason
        self._event.set()

    def remaining(self) -> float | None:
        """Seconds left before the deadline (never negative); None without one."""
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - time.monotonic())

    def check(self) -> None:
        """Raise when the work must stop.

        Raises:
            RequestAbandonedError: :meth:`cancel` was called.
            WorkLimitError: the deadline passed.
        """
        if self._event.is_set():
            raise RequestAbandonedError(f"stopped {self.what}: {self._reason}")
        if self._deadline is not None and time.monotonic() > self._deadline:
            raise WorkLimitError(f"{self.what} took longer than the limit of {self.limit_s:g} s")


def check(token: CancelToken | None) -> None:
    """``token.check()`` when a token is given."""
    if token is not None:
        token.check()
