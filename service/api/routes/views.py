"""Response bodies built from the job manager's objects, as JSON-ready data.

A job's view is cached by the job's version (it changes with the state, warnings and
result, not with the byte counts), so that polling a job costs a dictionary copy and
its encoding, whatever the size of its plan."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from service.api.errors import scrub_paths
from service.api.registry import ResidentModel
from service.api.runner import JobState, LoadJob

if TYPE_CHECKING:
    from service.loader.model import MemoryReport


def memory_out(report: MemoryReport) -> dict[str, Any]:
    return report.to_dict()


def memory_summary(report: MemoryReport) -> dict[str, Any]:
    """Bytes per device and buffer type, and in all: what listings show (a report has a
    line per buffer, and a split model mapped has a buffer per split)."""
    return {"by_device": report.by_device(), "total_bytes": report.total_nbytes, "n_buffers": len(report.buffers)}


def resident_summary(resident: ResidentModel) -> dict[str, Any]:
    """:func:`memory_summary` of a resident model, from what it computed once."""
    report = resident.loaded.report
    return {"by_device": resident.by_device, "total_bytes": report.total_nbytes, "n_buffers": len(report.buffers)}


def _job_static(job: LoadJob, models_dir: str) -> dict[str, Any]:
    base = f"/v1/loads/{job.id}"
    data = {
        "id": job.id,
        "object": "load_job",
        "model": job.model,
        "load_mode": job.load_mode,
        "state": job.state.value,
        "cancel_requested": job.cancel_requested,
        "n_tensors": job.n_tensors,
        "plan": job.plan_summary,
        "warnings": list(job.warnings),
        "stats": job.stats,
        "error": job.error,
        "memory": memory_out(job.report) if job.report is not None else None,
        "memory_summary": job.memory_summary,
        "model_id": job.model_id if job.state is JobState.SUCCEEDED else None,
        "name": job.name,
        "shared": job.shared,
        "keep_alive": job.keep_alive_s,
        "created_at": job.created_at.isoformat(),
        "started_at": job.started_at.isoformat() if job.started_at else None,
        "finished_at": job.finished_at.isoformat() if job.finished_at else None,
        "links": {"self": base, "plan": f"{base}/plan", "cancel": f"{base}/cancel"},
    }
    out: dict[str, Any] = scrub_paths(data, models_dir)
    return out


def _cached(job: LoadJob, models_dir: str) -> tuple[dict[str, Any], bytes]:
    """The job's view without its byte counts, as data and as JSON without the closing
    brace; rebuilt when the job's version changes."""
    cached = job.view
    if cached is None or cached[0] != job.version:
        static = _job_static(job, models_dir)
        encoded = json.dumps(static, ensure_ascii=False, separators=(",", ":")).encode()
        cached = job.view = (job.version, static, encoded[:-1])
    return cached[1], cached[2]


def job_out(job: LoadJob, models_dir: str) -> dict[str, Any]:
    """A job as ``GET /v1/loads/{id}`` shows it."""
    data = dict(_cached(job, models_dir)[0])
    data["bytes_done"] = job.bytes_done
    data["bytes_total"] = job.bytes_total
    data["progress"] = round(job.progress, 6)
    data["callback"] = job.callback.to_dict() if job.callback is not None else None
    return data


def job_json(job: LoadJob, models_dir: str) -> bytes:
    """:func:`job_out` encoded as JSON, from the cached encoding of all but the counts."""
    head = _cached(job, models_dir)[1]
    counts = f',"bytes_done":{job.bytes_done},"bytes_total":{job.bytes_total},"progress":{round(job.progress, 6)}'
    callback = json.dumps(job.callback.to_dict() if job.callback is not None else None, ensure_ascii=False)
    return head + counts.encode() + b',"callback":' + callback.encode() + b"}"


def job_listed(job: LoadJob, models_dir: str) -> dict[str, Any]:
    """A job as ``GET /v1/loads`` lists it: without the ``memory`` key (its report; the
    summary is kept)."""
    data = job_out(job, models_dir)
    del data["memory"]
    return data


def model_out(resident: ResidentModel, *, full: bool = True, freed: bool = False) -> dict[str, Any]:
    """A resident model; ``full``: with its memory report (key ``memory``), else its
    summary only, as listings show it; ``freed``: as the unload that freed it answers."""
    data = {
        "id": resident.id,
        "object": "model",
        "name": resident.name,
        "model": resident.model,
        "state": "unloaded" if freed else "resident",
        "references": resident.references,
        "keep_alive": resident.keep_alive_s,
        "expires_at": resident.expires_at.isoformat() if resident.expires_at else None,
        "last_used_at": resident.last_used_at.isoformat(),
        "load_mode": resident.loaded.load_mode,
        "n_tensors": len(resident.loaded),
        "loaded_at": resident.loaded_at.isoformat(),
        "memory_summary": resident_summary(resident),
    }
    if full:
        data["memory"] = memory_out(resident.loaded.report)
    return data
