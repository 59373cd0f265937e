"""Webhooks: a load's events POSTed to the callback URL its request gave.

Each job with a callback gets a background sender that follows the job's events like
any other subscriber (:meth:`~service.api.events.EventHub.follow`: publishing never
waits for it) into a bounded outbox, and delivers them in order, one at a time, with
``httpx``. Progress is taken at most every ``min_interval_s`` and, while the receiver is
slow, only the latest progress waits (a newer one replaces it). A delivery that fails
for a connection error, a time-out or a 5xx answer is retried with exponential backoff
and jitter, each event for at most ``HOIST_CALLBACK_RETRY_S``: the final event
(``report``, ``error``, ``state`` cancelled) for all that time, other events
:data:`EVENT_ATTEMPTS` times at most, progress :data:`PROGRESS_ATTEMPTS` times (and not
once a newer event waits). A 3xx (redirects are not followed)
or 4xx answer, or an address not allowed, fails at once. Whatever the receiver does,
the load runs as it would without a callback; the job's view counts what happened
(:class:`DeliveryStatus`).

Every delivery resolves the host and checks each address
(:meth:`~service.api.callback_policy.AllowList.resolve`), then connects to the checked
address itself — the URL's host replaced by the address, the ``Host`` header and the TLS
server name (SNI, and so certificate verification) kept as the name — so that a name
cannot resolve to one address when checked and another when connected. The answer's
status is read; its body never is.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from service import __version__
from service.api.callback_policy import AllowList, Target
from service.api.events import Event, EventHub
from service.errors import CallbackRefusedError, clip

if TYPE_CHECKING:
    import httpx

    from service.api.runner import LoadJob

logger = logging.getLogger(__name__)

DEFAULT_EVENTS: frozenset[str] = frozenset({"progress", "state", "warning", "report", "error"})
"""Event types delivered when a callback names none."""

CALLBACK_EVENTS: tuple[str, ...] = ("snapshot", "progress", "state", "warning", "report", "error")
"""Event types a callback may ask for (heartbeats are not sent)."""

OUTBOX_EVENTS = 64
"""Events that may wait for delivery per job; beyond, the oldest non-final one is dropped."""

MAX_CONCURRENT_DELIVERIES = 16

MAX_PER_TARGET = 4
"""Deliveries in flight to one host and port at most, so that receivers that hang hold
only their own share of :data:`MAX_CONCURRENT_DELIVERIES`."""
"""Deliveries in flight at once, over all jobs."""

PROGRESS_ATTEMPTS = 2
EVENT_ATTEMPTS = 5
BACKOFF_BASE_S = 0.25
BACKOFF_MAX_S = 10.0
ATTEMPT_TIMEOUTS = 3
"""One attempt's whole time limit, in connect/read time-outs."""

SIGNATURE_HEADER = "Hoist-Signature"


def sign(secret: bytes, body: bytes, timestamp: int) -> str:
    """The ``Hoist-Signature`` value of ``body`` sent at ``timestamp`` (unix seconds):
    ``t=<timestamp>,v1=<hex HMAC-SHA256 of "<timestamp>.<body>">``."""
    mac = hmac.new(secret, f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


def backoff(attempt: int, rng: random.Random | None = None) -> float:
    """Seconds to wait before retry ``attempt`` (1 for the first): exponential from
    :data:`BACKOFF_BASE_S`, at most :data:`BACKOFF_MAX_S`, with jitter (half to all)."""
    delay = min(BACKOFF_BASE_S * 2 ** min(attempt - 1, 30), BACKOFF_MAX_S)
    return float(delay * (0.5 + 0.5 * (rng or random).random()))


@dataclass(frozen=True, slots=True)
class CallbackSpec:
    """A load's callback as its request gives it.

    Attributes:
        url: where the events are POSTed.
        events: the event types sent.
        min_interval_s: least time between two progress deliveries, in seconds.
    """

    url: str
    events: frozenset[str] = DEFAULT_EVENTS
    min_interval_s: float = 1.0


@dataclass(eq=False)
class DeliveryStatus:
    """What a job's callback did (its view's ``callback``).

    Attributes:
        target: ``scheme://host:port`` of the URL.
        delivered: events the receiver accepted (2xx).
        retried: attempts repeated after a failure.
        dropped: events given up on (failed, or the outbox full).
        coalesced: progress events replaced by newer progress while waiting.
        pending: events waiting.
        last_error: why the latest failed attempt failed.
        last_status: the HTTP status of the latest answer.
        done: the sender ended (the final event delivered or given up on).
    """

    target: str
    delivered: int = 0
    retried: int = 0
    dropped: int = 0
    coalesced: int = 0
    pending: int = 0
    last_error: str | None = None
    last_status: int | None = None
    done: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "delivered": self.delivered,
            "retried": self.retried,
            "dropped": self.dropped,
            "coalesced": self.coalesced,
            "pending": self.pending,
            "last_error": self.last_error,
            "last_status": self.last_status,
            "done": self.done,
        }


class _Failed(Exception):
    """One failed attempt; ``retry``: whether another may succeed."""

    def __init__(self, message: str, *, retry: bool, status: int | None = None) -> None:
        super().__init__(message)
        self.retry = retry
        self.status = status


@dataclass(eq=False)
class _Outbox:
    """A job's events waiting for delivery: bounded, progress coalesced."""

    size: int
    items: deque[Event] = field(default_factory=deque)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    closed: bool = False

    def put(self, event: Event, status: DeliveryStatus) -> None:
        if event.kind == "progress" and self.items and self.items[-1].kind == "progress":
            self.items[-1] = event  # the receiver is behind: only the latest bytes matter
            status.coalesced += 1
        else:
            if len(self.items) >= self.size:
                victim = next((e for e in self.items if not e.final), None)
                if victim is not None:
                    self.items.remove(victim)
                    status.dropped += 1
            self.items.append(event)
        status.pending = len(self.items)
        self.ready.set()


class Callbacks:
    """The callback senders of every job, the HTTP client they share, and the bound on
    deliveries in flight.

    Args:
        hub: the jobs' events.
        allow: ``HOIST_CALLBACK_HOSTS``.
        secret: ``HOIST_CALLBACK_SECRET`` (None: requests are not signed).
        timeout_s: connect and read time limit of one attempt, in seconds.
        final_retry_s: how long the final event is retried (others at most as long), in
            seconds.
    """

    def __init__(
        self,
        hub: EventHub,
        allow: AllowList,
        *,
        secret: str | None = None,
        timeout_s: float = 5.0,
        final_retry_s: float = 60.0,
        max_concurrent: int = MAX_CONCURRENT_DELIVERIES,
    ) -> None:
        self.hub = hub
        self.allow = allow
        self.secret = secret.encode() if secret else None
        self.timeout_s = timeout_s
        self.final_retry_s = final_retry_s
        self._slots = asyncio.Semaphore(max_concurrent)
        self._per_target: dict[tuple[str, int], tuple[asyncio.Semaphore, int]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._client: httpx.AsyncClient | None = None

    @contextlib.asynccontextmanager
    async def _slot(self, target: Target) -> AsyncIterator[None]:
        """A delivery slot: one of ``target``'s (host and port) first, then one of all."""
        key = (target.host, target.port)
        sem, users = self._per_target.get(key, (None, 0))
        if sem is None:
            sem = asyncio.Semaphore(MAX_PER_TARGET)
        self._per_target[key] = (sem, users + 1)
        try:
            async with sem, self._slots:
                yield
        finally:
            sem, users = self._per_target[key]
            if users > 1:
                self._per_target[key] = (sem, users - 1)
            else:
                del self._per_target[key]

    def check(self, spec: CallbackSpec) -> Target:
        """The callback's URL checked (form and allow-list). Raises CallbackRefusedError."""
        return self.allow.check_url(spec.url)

    def _http(self) -> httpx.AsyncClient:
        import httpx  # with its command-line extras, a third of a second: not before the first callback

        if self._client is None:
            self._client = httpx.AsyncClient(
                follow_redirects=False,
                trust_env=False,  # no proxy: the connection goes to the address checked
                timeout=httpx.Timeout(self.timeout_s),
                limits=httpx.Limits(max_connections=MAX_CONCURRENT_DELIVERIES, max_keepalive_connections=0),
                headers={"User-Agent": f"hoist/{__version__}"},
            )
        return self._client

    def start(self, job: LoadJob, spec: CallbackSpec) -> None:
        """Start delivering ``job``'s events to ``spec.url`` (checked again here; the
        job's ``callback`` status is set). Call before the job's first event: the sender
        subscribes when the event loop next runs its tasks, ahead of the job's task when
        started first. Raises CallbackRefusedError."""
        target = self.check(spec)
        status = DeliveryStatus(target.origin)
        job.callback = status
        outbox = _Outbox(OUTBOX_EVENTS)
        # the reader first: it subscribes as soon as it runs, before the job's task does
        reader = asyncio.create_task(self._read(job, spec, outbox, status), name=f"callback reader {job.id}")
        sender = asyncio.create_task(self._run(job, target, outbox, status, reader), name=f"callback {job.id}")
        for task in (reader, sender):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Cancel every sender, wait for them, and close the client."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # -- one job's sender -----------------------------------------------------------

    async def _run(
        self, job: LoadJob, target: Target, outbox: _Outbox, status: DeliveryStatus, reader: asyncio.Task[None]
    ) -> None:
        try:
            await self._deliver_all(job, target, outbox, status)
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            status.done = True
            status.pending = len(outbox.items)

    async def _read(self, job: LoadJob, spec: CallbackSpec, outbox: _Outbox, status: DeliveryStatus) -> None:
        last_progress = float("-inf")
        loop = asyncio.get_running_loop()
        try:
            async for event in self.hub.follow(job):
                if event.final:
                    if event.kind in spec.events:
                        outbox.put(event, status)
                    return
                if event.kind not in spec.events:
                    continue
                if event.kind == "progress":
                    now = loop.time()
                    if now - last_progress < spec.min_interval_s:
                        continue
                    last_progress = now
                outbox.put(event, status)
        finally:
            outbox.closed = True
            outbox.ready.set()

    async def _deliver_all(self, job: LoadJob, target: Target, outbox: _Outbox, status: DeliveryStatus) -> None:
        while True:
            if not outbox.items:
                if outbox.closed:
                    return
                outbox.ready.clear()
                await outbox.ready.wait()
                continue
            event = outbox.items.popleft()
            delivered = await self._deliver(job, target, event, outbox, status)
            status.pending = len(outbox.items)
            if delivered:
                status.delivered += 1
            else:
                status.dropped += 1

    async def _deliver(
        self, job: LoadJob, target: Target, event: Event, outbox: _Outbox, status: DeliveryStatus
    ) -> bool:
        """Send ``event`` until it is accepted or given up on; True when accepted."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.final_retry_s
        attempt = 0
        while True:
            attempt += 1
            try:
                async with self._slot(target):
                    code = await self._post(job, target, event)
                status.last_status = code
                return True
            except _Failed as exc:
                status.last_error = clip(str(exc), 300)
                if exc.status is not None:
                    status.last_status = exc.status
                if not exc.retry:
                    return False
            wait = backoff(attempt)
            if loop.time() + wait > deadline:
                return False
            if event.final:
                pass
            elif event.kind == "progress":
                # a newer event carries newer bytes: this one is not worth retrying
                if attempt >= PROGRESS_ATTEMPTS or outbox.items:
                    return False
            elif attempt >= EVENT_ATTEMPTS:
                return False
            status.retried += 1
            await asyncio.sleep(wait)

    async def _post(self, job: LoadJob, target: Target, event: Event) -> int:
        """One attempt: resolve and check, connect to the address checked, POST, read
        the status (not the body). Returns the 2xx status. Raises _Failed."""
        try:
            address = await self.allow.resolve(target)
        except CallbackRefusedError as exc:
            raise _Failed(exc.message, retry=False) from None
        host = f"[{address}]" if address.version == 6 else str(address)
        url = f"{target.scheme}://{host}:{target.port}{target.target}"
        body = event.data.encode()
        headers = {
            "Host": target.host_header,
            "Content-Type": "application/json",
            "Hoist-Event": event.kind,
            "Hoist-Job": job.id,
            "Hoist-Seq": str(event.seq),
        }
        if self.secret is not None:
            headers[SIGNATURE_HEADER] = sign(self.secret, body, int(time.time()))
        extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
        client = self._http()
        import httpx

        try:
            # the read time-out bounds each read; this bounds a receiver that dribbles
            async with asyncio.timeout(self.timeout_s * ATTEMPT_TIMEOUTS):
                request = client.build_request("POST", url, content=body, headers=headers, extensions=extensions)
                response = await client.send(request, stream=True)
                await response.aclose()  # the body is never read
        except TimeoutError:
            raise _Failed("timed out", retry=True) from None
        except httpx.TimeoutException as exc:
            raise _Failed(f"timed out ({type(exc).__name__})", retry=True) from None
        except httpx.HTTPError as exc:
            raise _Failed(f"{type(exc).__name__}: {clip(str(exc), 200)}", retry=True) from None
        code = response.status_code
        if 200 <= code < 300:
            return code
        if 300 <= code < 400:
            raise _Failed(f"answered {code} (redirects are not followed)", retry=False, status=code)
        raise _Failed(f"answered {code}", retry=code >= 500, status=code)
