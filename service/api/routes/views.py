"""Response bodies built from the job manager's objects."""

from __future__ import annotations

from service.api.jobs import JobState, LoadJob, ResidentModel
from service.api.schemas import LoadJobOut, MemoryReportOut, ModelOut
from service.loader.model import MemoryReport


def memory_out(report: MemoryReport) -> MemoryReportOut:
    return MemoryReportOut.model_validate(report.to_dict())


def job_out(job: LoadJob) -> LoadJobOut:
    base = f"/v1/loads/{job.id}"
    return LoadJobOut(
        id=job.id,
        model=job.model,
        load_mode=job.load_mode,
        state=job.state.value,
        cancel_requested=job.cancel_requested,
        progress=round(job.progress, 6),
        bytes_done=job.bytes_done,
        bytes_total=job.bytes_total,
        n_tensors=job.n_tensors,
        plan=job.plan.to_dict(tensors=False),
        warnings=job.warnings,
        stats=job.stats,
        error=job.error,
        memory=memory_out(job.report) if job.report is not None else None,
        model_id=job.id if job.state is JobState.SUCCEEDED else None,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        links={"self": base, "cancel": f"{base}/cancel"},
    )


def model_out(resident: ResidentModel) -> ModelOut:
    return ModelOut(
        id=resident.id,
        model=resident.model,
        load_mode=resident.loaded.load_mode,
        n_tensors=len(resident.loaded),
        loaded_at=resident.loaded_at,
        memory=memory_out(resident.loaded.report),
    )
