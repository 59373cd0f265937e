"""Prometheus metrics (``GET /metrics``, the text exposition format), in a registry of
the app's own.

Three sources:

- :class:`LoadMetrics`, counters and a histogram the job manager updates as loads run
  (it is the runner's :class:`~service.api.runner.LoadObserver`);
- :class:`StateCollector`, gauges read at scrape time: loads running and queued,
  resident models, the bytes each resident model holds per device and buffer type, each
  device's free and total memory;
- prometheus-fastapi-instrumentator's middleware: requests and their latency by route
  template, method and status class.

Label values are bounded: load modes, outcomes and device kinds are closed sets; routes
are templates (an unmatched path is ``none``); status codes are grouped (``2xx``); model
labels exist only for resident models (a model's series disappear with it); no label
carries a job id.

A scrape takes the service's state on the event loop (a pass over the jobs and the
resident models, bounded by the job history), then queries the devices' memory (a CUDA
query may block) and renders the text on a thread of its own. One scrape runs at a time:
scrapes that arrive meanwhile share its result, and one that waits longer than
:data:`SCRAPE_TIMEOUT_S` is answered ``429``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import FastAPI
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_fastapi_instrumentator import Instrumentator
from prometheus_fastapi_instrumentator import metrics as http_metrics

from service.api.jobs import JobManager, JobState, LoadJob
from service.errors import BusyError
from service.loader.devices import Device

logger = logging.getLogger(__name__)

# no ``*_created`` series beside every counter and histogram (they double the series
# and no dashboard needs them); this holds for the whole process
disable_created_metrics()  # type: ignore[no-untyped-call]

NAMESPACE = "hoist"

SCRAPE_TIMEOUT_S = 5.0
"""Longest a scrape waits for the device memory queries and the rendering."""

LOAD_DURATION_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500)
"""Upper bounds of the load duration histogram's buckets, in seconds."""

HTTP_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
"""Upper bounds of the request latency histogram's buckets, in seconds."""


def device_kind(types: Iterable[str]) -> str:
    """The ``device_kind`` label of a load whose buffers lie on devices of llama.cpp
    device types ``types`` (``CPU``, ``GPU``, ``IGPU``, ``ACCEL``): the types, lower
    case, sorted and joined with ``+`` (``cpu``, ``cpu+gpu``)."""
    return "+".join(sorted({t.lower() for t in types})) or "none"


class LoadMetrics:
    """Counters and a histogram of loads, updated on the event loop as loads run.

    Metrics (in ``registry``):
        ``hoist_loads_total{load_mode, outcome}``: loads that ended, by effective load
            mode (``none``, ``mmap``, ``mlock``, ``mmap+mlock``, ``direct-io``) and
            outcome (``succeeded``, ``failed``, ``cancelled``).
        ``hoist_load_bytes_total{load_mode}``: tensor bytes brought into memory by
            loads, counted as they progress (a failed or cancelled load's bytes too).
        ``hoist_load_duration_seconds{load_mode, device_kind}``: from running to
            succeeded, for loads that succeeded; ``device_kind`` as :func:`device_kind`
            of the devices holding the model's buffers.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.loads = Counter(
            "loads",
            "Load jobs that ended, by effective load mode and outcome.",
            ["load_mode", "outcome"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.bytes = Counter(
            "load_bytes",
            "Tensor bytes brought into memory by loads, counted as they progress.",
            ["load_mode"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.duration = Histogram(
            "load_duration_seconds",
            "Time from running to succeeded of the loads that succeeded, in seconds.",
            ["load_mode", "device_kind"],
            namespace=NAMESPACE,
            registry=registry,
            buckets=LOAD_DURATION_BUCKETS,
        )
        self._types: dict[str, str] = {}

    def bind(self, devices: Sequence[Device]) -> None:
        """Use ``devices`` (the service's) to tell the kind of device a model lies on."""
        self._types = {d.name: d.type for d in devices}

    def load_progressed(self, job: LoadJob, nbytes: int) -> None:
        if nbytes > 0:
            self.bytes.labels(job.load_mode).inc(nbytes)

    def load_ended(self, job: LoadJob) -> None:
        if not job.state.terminal:  # the service is stopping: its queued jobs never ran
            return
        self.loads.labels(job.load_mode, job.state.value).inc()
        if job.state is JobState.SUCCEEDED and job.started_at is not None and job.finished_at is not None:
            on = (job.memory_summary or {}).get("by_device", {})
            kind = device_kind(self._types.get(name, "unknown") for name in on)
            seconds = (job.finished_at - job.started_at).total_seconds()
            self.duration.labels(job.load_mode, kind).observe(max(seconds, 0.0))


@dataclass(frozen=True, slots=True)
class ServiceState:
    """What a scrape reports of the job manager, taken at once on the event loop.

    Attributes:
        running: loads in state ``running``.
        queued: loads in state ``queued``.
        resident: ``(model, {device: {buffer_type: bytes}})`` per resident model.
    """

    running: int
    queued: int
    resident: tuple[tuple[str, dict[str, dict[str, int]]], ...]

    @classmethod
    def take(cls, jobs: JobManager) -> ServiceState:
        """The state of ``jobs`` now; call it on the event loop that runs them."""
        running = queued = 0
        for job in jobs.jobs.values():
            if job.state is JobState.RUNNING:
                running += 1
            elif job.state is JobState.QUEUED:
                queued += 1
        # a resident model's bytes per device were computed once, and never change
        resident = tuple((r.name, r.by_device) for r in jobs.models.values())
        return cls(running, queued, resident)


class StateCollector:
    """Gauges of a :class:`ServiceState` and of the devices' memory, queried as the
    collector is collected (on the scrape thread).

    Metrics:
        ``hoist_loads_running``, ``hoist_loads_queued``: loads active and waiting.
        ``hoist_resident_models``: models loaded and held.
        ``hoist_model_memory_bytes{device, buffer_type, model}``: bytes the resident
            models of ``model`` (the path as requested) hold per device and buffer type,
            as their memory reports give them (``/v1/devices`` shows the same numbers).
        ``hoist_device_free_bytes{device, kind}``, ``hoist_device_total_bytes{device,
            kind}``: each device's memory now, as ``/v1/devices`` reports it; a device
            whose query fails is left out of that scrape (and logged).
    """

    def __init__(self, state: ServiceState, devices: Sequence[Device]) -> None:
        self.state = state
        self.devices = devices

    def collect(self) -> Iterable[Metric]:
        state = self.state
        yield GaugeMetricFamily(f"{NAMESPACE}_loads_running", "Load jobs running now.", value=state.running)
        yield GaugeMetricFamily(f"{NAMESPACE}_loads_queued", "Load jobs waiting to run.", value=state.queued)
        yield GaugeMetricFamily(
            f"{NAMESPACE}_resident_models", "Models loaded and held in memory.", value=len(state.resident)
        )
        held: dict[tuple[str, str, str], int] = {}
        for model, by_device in state.resident:
            for name, per_type in by_device.items():
                for buffer_type, nbytes in per_type.items():
                    key = (name, buffer_type, model)
                    held[key] = held.get(key, 0) + nbytes
        family = GaugeMetricFamily(
            f"{NAMESPACE}_model_memory_bytes",
            "Bytes resident models hold, per device, buffer type and model.",
            labels=["device", "buffer_type", "model"],
        )
        for key, nbytes in sorted(held.items()):
            family.add_metric(list(key), nbytes)
        yield family
        free = GaugeMetricFamily(
            f"{NAMESPACE}_device_free_bytes", "Device memory free now, in bytes.", labels=["device", "kind"]
        )
        total = GaugeMetricFamily(
            f"{NAMESPACE}_device_total_bytes", "Device memory in all, in bytes.", labels=["device", "kind"]
        )
        for device in self.devices:
            try:
                mem = device.memory()
            except Exception:  # one device's failure must not fail the scrape
                logger.warning("cannot read the memory of %s for the metrics", device.name, exc_info=True)
                continue
            labels = [device.name, device.type.lower()]
            free.add_metric(labels, mem.free)
            total.add_metric(labels, mem.total)
        yield free
        yield total


class _Collectors:
    """Several collectors as one, for one rendering."""

    def __init__(self, *collectors: Collector) -> None:
        self.collectors = collectors

    def collect(self) -> Iterable[Metric]:
        for collector in self.collectors:
            yield from collector.collect()


def _consume(future: asyncio.Future[bytes]) -> None:
    """Retrieve a scrape's failure, so that one nobody awaited any more is not reported
    as never retrieved."""
    if not future.cancelled():
        future.exception()


class Metrics:
    """The service's metrics: a registry of its own (so that several apps may live in
    one process), the load metrics, the request instrumentation, and the scrape.

    Attributes:
        registry: the counters and histograms (and the ``process_*`` metrics).
        loads: the job runner's observer.
    """

    def __init__(self, timeout_s: float = SCRAPE_TIMEOUT_S) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.loads = LoadMetrics(self.registry)
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hoist-metrics")
        self._scrape: asyncio.Future[bytes] | None = None

    def instrument(self, app: FastAPI) -> None:
        """Add the request metrics' middleware to ``app``:
        ``hoist_http_requests_total{handler, method, status}`` and
        ``hoist_http_request_duration_seconds{handler, method}``, ``handler`` the route
        template (``none`` for a path no route matches), ``status`` grouped (``4xx``)."""
        instrumentator = Instrumentator(
            should_group_status_codes=True, should_group_untemplated=True, registry=self.registry
        )
        instrumentator.add(
            http_metrics.requests(metric_namespace=NAMESPACE, registry=self.registry),
            http_metrics.latency(
                metric_namespace=NAMESPACE,
                should_include_status=False,
                buckets=HTTP_DURATION_BUCKETS,
                registry=self.registry,
            ),
        )
        instrumentator.instrument(app)

    async def exposition(self, jobs: JobManager) -> bytes:
        """The metrics in the text exposition format (``CONTENT_TYPE_LATEST``).

        Raises:
            BusyError: the scrape under way took longer than ``timeout_s`` (a device
                memory query may hang).
        """
        if self._scrape is None or self._scrape.done():
            state = ServiceState.take(jobs)
            every = _Collectors(self.registry, StateCollector(state, jobs.devices))
            self._scrape = asyncio.get_running_loop().run_in_executor(self._pool, generate_latest, every)
            self._scrape.add_done_callback(_consume)
        try:
            async with asyncio.timeout(self.timeout_s):
                return await asyncio.shield(self._scrape)
        except TimeoutError:
            raise BusyError(
                f"collecting the metrics took longer than {self.timeout_s:g} s (a device memory query is slow)",
                retry_after=5,
            ) from None

    def close(self) -> None:
        """Let the scrape thread end (a scrape under way finishes first)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
