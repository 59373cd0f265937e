"""Live events of load jobs: one channel per job that the job manager publishes to and
any number of subscribers follow (websocket, server-sent events, in-process iterators).

Publishing never waits: each subscriber has a bounded queue, and one that falls behind
(its queue full) loses its backlog and gets a fresh ``snapshot`` instead when it reads
next, so that a slow or vanished subscriber costs the load nothing. Progress is sent at
most every ``progress_interval_s`` (the latest bytes, once the interval is over). Each
channel keeps its recent events for resumption (``Last-Event-ID``) while the job runs,
and its final event for as long as the job is kept. The JSON shape of the events is
:mod:`.event_schema`.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from service.api.errors import scrub_paths

if TYPE_CHECKING:
    from service.api.runner import LoadJob

PROGRESS_INTERVAL_S = 0.1
"""Least time between two progress events of a job (about ten a second)."""

HEARTBEAT_S = 15.0
"""Seconds without an event after which a subscriber gets a heartbeat."""

QUEUE_EVENTS = 64
"""Events a subscriber may fall behind by before its backlog is replaced by a snapshot."""

HISTORY_EVENTS = 256
"""Recent events a running job keeps for resumption (about 25 s of progress)."""

FINAL_KINDS = frozenset({"report", "error"})


@dataclass(frozen=True, slots=True)
class Event:
    """One event, encoded once for every subscriber.

    Attributes:
        seq: the job's event number (see :mod:`.event_schema`).
        kind: ``snapshot``, ``progress``, ``state``, ``warning``, ``report``, ``error``
            or ``heartbeat``.
        data: the event as JSON text.
        final: the stream ends after it.
    """

    seq: int
    kind: str
    data: str
    final: bool = False

    def json(self) -> dict[str, Any]:
        """The event as data."""
        value: dict[str, Any] = json.loads(self.data)
        return value


@dataclass(eq=False)
class Subscriber:
    """One follower's bounded queue; ``lagging`` once it overflowed (its backlog dropped)."""

    size: int
    items: deque[Event] = field(default_factory=deque)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    lagging: bool = False

    def offer(self, event: Event) -> None:
        if self.lagging:
            return  # the snapshot it gets next covers this event
        if len(self.items) >= self.size:
            self.lagging = True
            self.items.clear()
        else:
            self.items.append(event)
        self.ready.set()


@dataclass(eq=False)
class Channel:
    """A job's events: counter, recent history, final event, subscribers, and the
    progress not yet sent. It keeps no reference to its job (the hub's key)."""

    seq: int = 0
    history: deque[Event] = field(default_factory=lambda: deque(maxlen=HISTORY_EVENTS))
    final: Event | None = None
    subscribers: set[Subscriber] = field(default_factory=set)
    by_device: dict[str, int] = field(default_factory=dict)
    last_progress: float = float("-inf")
    pending: asyncio.TimerHandle | None = None

    def replayable(self, after: int) -> bool:
        """True when every event after number ``after`` is still held."""
        if after > self.seq or after < 0:
            return False
        if after == self.seq:
            return True
        return bool(self.history) and self.history[0].seq <= after + 1


def _utc() -> datetime:
    return datetime.now(UTC)


class EventHub:
    """The channels of every job (dropped with their jobs: the keys are weak).

    Args:
        models_dir: file paths in warnings and errors are shown relative to it.
        progress_interval_s: least time between two progress events of a job.
        queue_events: see :data:`QUEUE_EVENTS`.
        heartbeat_s: see :data:`HEARTBEAT_S`.
    """

    def __init__(
        self,
        models_dir: str,
        *,
        progress_interval_s: float = PROGRESS_INTERVAL_S,
        queue_events: int = QUEUE_EVENTS,
        heartbeat_s: float = HEARTBEAT_S,
    ) -> None:
        self.models_dir = models_dir
        self.progress_interval_s = progress_interval_s
        self.queue_events = queue_events
        self.heartbeat_s = heartbeat_s
        self._channels: weakref.WeakKeyDictionary[LoadJob, Channel] = weakref.WeakKeyDictionary()

    def channel(self, job: LoadJob) -> Channel:
        """The channel of ``job`` (made on first use)."""
        ch = self._channels.get(job)
        if ch is None:
            ch = self._channels[job] = Channel()
        return ch

    # -- making events --------------------------------------------------------------------

    def _data(self, job: LoadJob, ch: Channel, kind: str, seq: int, final: bool) -> dict[str, Any]:
        now = _utc()
        throughput: float | None = None
        eta: float | None = None
        if job.started_at is not None:
            elapsed = ((job.finished_at or now) - job.started_at).total_seconds()
            if elapsed > 0:
                throughput = job.bytes_done / elapsed
            if job.state.terminal:
                eta = 0.0
            elif throughput:
                eta = (job.bytes_total - job.bytes_done) / throughput
        done = job.bytes_done
        total = job.bytes_total
        return {
            "event": kind,
            "job_id": job.id,
            "seq": seq,
            "time": now.isoformat(),
            "state": job.state.value,
            "bytes_done": done,
            "bytes_total": total,
            "progress": min(done / total, 1.0) if total else float(job.state.terminal),
            "throughput_bps": throughput,
            "eta_s": eta,
            "by_device": dict(ch.by_device),
            "final": final,
        }

    def _report(self, job: LoadJob) -> dict[str, Any]:
        from service.api.routes.views import memory_out  # the views import the jobs

        load_time = None
        if job.started_at is not None and job.finished_at is not None:
            load_time = (job.finished_at - job.started_at).total_seconds()
        return {
            "model_id": job.id,
            "load_time_s": load_time,
            "memory_summary": job.memory_summary,
            "memory": memory_out(job.report) if job.report is not None else None,
            "plan_lines": list(job.plan_summary.get("lines", [])),
            "stats": job.stats,
        }

    def _encode(self, data: dict[str, Any]) -> str:
        return json.dumps(scrub_paths(data, self.models_dir), ensure_ascii=False, separators=(",", ":"))

    def snapshot(self, job: LoadJob) -> Event:
        """The job as it is now, numbered as the latest event it includes."""
        ch = self.channel(job)
        data = self._data(job, ch, "snapshot", ch.seq, False)
        data.update(model=job.model, warnings=list(job.warnings), error=job.error)
        return Event(ch.seq, "snapshot", self._encode(data))

    def heartbeat(self, job: LoadJob) -> Event:
        """A heartbeat, numbered as the latest event."""
        ch = self.channel(job)
        return Event(ch.seq, "heartbeat", self._encode(self._data(job, ch, "heartbeat", ch.seq, False)))

    # -- publishing -----------------------------------------------------------------------

    def publish(
        self, job: LoadJob, kind: str, *, warning: str = "", by_device: Mapping[str, int] | None = None
    ) -> None:
        """Tell the subscribers of ``job`` what happened, from the job as it is now.

        Args:
            job: the job (its state, bytes and results are read now).
            kind: ``progress`` (sent at most every ``progress_interval_s``; ``by_device``
                the bytes per device so far), ``state`` (the job changed state; final when
                it is ``cancelled``), ``warning`` (``warning`` the text), ``report`` (the
                load succeeded) or ``error`` (it failed); ``report`` and ``error`` are
                preceded by the ``state`` event of the job's final state.

        Never blocks and never raises for a slow subscriber.
        """
        ch = self.channel(job)
        if ch.final is not None:
            return
        if by_device is not None:
            ch.by_device = dict(by_device)
        if kind == "progress":
            self._progress(job, ch)
            return
        if ch.pending is not None:  # the event below carries the bytes as well
            ch.pending.cancel()
            ch.pending = None
        if kind in FINAL_KINDS:
            self._emit(job, ch, "state", False)
        final = kind in FINAL_KINDS or (kind == "state" and job.state.terminal and job.state.value == "cancelled")
        extra: dict[str, Any] = {}
        if kind == "warning":
            extra["warning"] = warning
        elif kind == "report":
            extra["report"] = self._report(job)
        elif kind == "error":
            extra["error"] = job.error or {"code": "internal_error", "message": "the load failed"}
        self._emit(job, ch, kind, final, extra)

    def _progress(self, job: LoadJob, ch: Channel) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        wait = ch.last_progress + self.progress_interval_s - now
        if wait <= 0:
            if ch.pending is not None:
                ch.pending.cancel()
                ch.pending = None
            ch.last_progress = now
            self._emit(job, ch, "progress", False)
        elif ch.pending is None:
            ch.pending = loop.call_later(wait, self._flush, job)

    def _flush(self, job: LoadJob) -> None:
        ch = self.channel(job)
        ch.pending = None
        if ch.final is None and not job.state.terminal:
            ch.last_progress = asyncio.get_running_loop().time()
            self._emit(job, ch, "progress", False)

    def _emit(self, job: LoadJob, ch: Channel, kind: str, final: bool, extra: dict[str, Any] | None = None) -> None:
        ch.seq += 1
        data = self._data(job, ch, kind, ch.seq, final)
        if extra:
            data.update(extra)
        event = Event(ch.seq, kind, self._encode(data), final)
        if final:
            ch.final = event
            ch.history.clear()  # an ended job keeps its final event only
        else:
            ch.history.append(event)
        for sub in ch.subscribers:
            sub.offer(event)

    # -- following ------------------------------------------------------------------------

    async def follow(self, job: LoadJob, *, after: int | None = None) -> AsyncIterator[Event]:
        """The events of ``job`` from now on: a snapshot first (or, with ``after``, the
        events after number ``after`` when they are all still held; once the job ended,
        its final event alone), then each event as
        it comes, heartbeats when nothing comes for ``heartbeat_s``, up to and including
        the final event. A follower that falls :data:`QUEUE_EVENTS` behind gets a fresh
        snapshot in place of its backlog."""
        ch = self.channel(job)
        if ch.final is None and job.state.terminal:  # ended without telling (never started)
            self._emit(job, ch, "state", True)
        sub = Subscriber(self.queue_events)
        ch.subscribers.add(sub)
        try:
            last = -1
            if after is not None and ch.final is not None and 0 <= after < ch.final.seq:
                # ended: of the events after ``after`` only the final one is kept
                yield ch.final
                return
            if after is not None and ch.replayable(after):
                for event in list(ch.history):
                    if event.seq > after:
                        yield event
                        last = event.seq
                last = max(last, after)
                if ch.final is not None and ch.final.seq <= last:
                    return
            else:
                snap = self.snapshot(job)
                yield snap
                last = snap.seq
            while True:
                if ch.final is not None and (sub.lagging or not sub.items):
                    # ended: what is still queued came before the final event (a
                    # snapshot just sent carries the final event's number: send it too)
                    if ch.final.seq >= last:
                        yield ch.final
                    return
                if sub.lagging:
                    sub.lagging = False
                    sub.items.clear()
                    snap = self.snapshot(job)
                    yield snap
                    last = snap.seq
                    continue
                if not sub.items:
                    sub.ready.clear()
                    try:
                        async with asyncio.timeout(self.heartbeat_s):
                            await sub.ready.wait()
                    except TimeoutError:
                        yield self.heartbeat(job)
                    continue
                event = sub.items.popleft()
                if event.seq <= last:
                    continue
                yield event
                last = event.seq
                if event.final:
                    return
        finally:
            ch.subscribers.discard(sub)

    def final_seq(self, job: LoadJob) -> int | None:
        """The number of the job's final event, once it was sent."""
        final = self.channel(job).final
        return None if final is None else final.seq
