"""The extent planner: which byte ranges of the model files are read (or faulted in) in
one operation, and where each one goes.

An :class:`Extent` is a range of one file whose bytes all go to one destination: a
region of a host buffer, a staging buffer of one device, a file mapping, or a temporary
buffer of one tensor. Consecutive tensors whose bytes lie in the file as they lie in
their destination (the same gaps) are served by extents that span their boundaries;
an extent never spans two destinations. Its size is bounded by the chunk that fits the
destination (the chunk size, the direct-read chunk, or a staging buffer's payload), and
with direct I/O its read range is aligned to the file's block size.

:func:`plan_extents` is a pure function of the tensor jobs and the limits.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from service.io.align import align_down, align_up
from service.loader.ggml_types import GGML_TYPES_BY_NAME
from service.loader.pipeline.layout import Branch, TensorJob
from service.loader.placement.buffers import RUN_ALIGNMENT

MERGED_BRANCHES: frozenset[Branch] = frozenset({"mapped", "read", "copy", "staged"})
"""Branches whose consecutive tensors can share an extent (the others: one tensor each)."""


@dataclass(frozen=True, slots=True)
class ExtentLimits:
    """How big an extent may be, in bytes of the file.

    Attributes:
        chunk_nbytes: payload of a buffered read, a copy or a mapped populate (the
            progress and cancellation step).
        direct_chunk_nbytes: payload of a direct read straight into a host buffer
            (rounded up to the file's alignment).
        staging_payload: bytes of tensor data one staging buffer takes (staged branch).
    """

    chunk_nbytes: int
    direct_chunk_nbytes: int
    staging_payload: int


@dataclass(slots=True)
class Piece:
    """The part ``[lo, hi)`` (file offsets) of one tensor that an extent brings in (not
    changed once built, like :class:`Extent`).

    Attributes:
        job: the tensor's job.
        lo: first file offset of the part.
        hi: end (exclusive) of the part; ``lo == hi`` only for a zero-byte tensor.
    """

    job: TensorJob
    lo: int
    hi: int

    @property
    def completes(self) -> bool:
        """The part ends the tensor: every byte of it is in place once this is."""
        return self.hi == self.job.offset + self.job.nbytes


@dataclass(slots=True)
class Extent:
    """One read (or populate) of a file range into one destination (not changed once
    built).

    Attributes:
        branch: how its bytes come in (every piece's job has this branch).
        file_index: the file.
        lo: first file offset of the payload (tensor bytes and the gaps between them).
        hi: end of the payload (exclusive).
        read_lo: where the read starts: ``lo`` aligned down to the file's block size
            when the read is aligned, else ``lo``.
        read_hi: where the read ends: ``hi`` aligned up, else ``hi``.
        pieces: the tensor parts of the payload, in file order.
        aligned: the read covers whole blocks of the file's direct-I/O block size, into
            an aligned destination (straight into a host buffer's slack, or a staging
            buffer); else exactly ``[lo, hi)`` is read.
    """

    branch: Branch
    file_index: int
    lo: int
    hi: int
    read_lo: int
    read_hi: int
    pieces: tuple[Piece, ...]
    aligned: bool = False

    @property
    def first(self) -> TensorJob:
        """The job of the first piece (its destination is the extent's)."""
        return self.pieces[0].job

    @property
    def dest_offset(self) -> int:
        """Offset of file byte ``lo`` in the destination buffer (read, copy, staged)."""
        first = self.first
        return first.dest_offset + (self.lo - first.offset)

    @property
    def nbytes(self) -> int:
        """Tensor bytes the extent brings in (gaps between tensors excluded)."""
        return sum(p.hi - p.lo for p in self.pieces)


def _joins(prev: TensorJob, job: TensorJob) -> bool:
    """Whether ``job`` continues the group ending with ``prev`` into the same destination."""
    if prev.branch != job.branch or prev.file_index != job.file_index or job.branch not in MERGED_BRANCHES:
        return False
    if job.branch == "mapped":
        gap = job.offset - (prev.offset + prev.nbytes)
        return prev.mapping is job.mapping and prev.lock is job.lock and 0 <= gap < RUN_ALIGNMENT
    same_dest = prev.dest is job.dest and prev.in_place == job.in_place and prev.device is job.device
    delta = job.offset - prev.offset
    if not job.in_place and delta - prev.nbytes >= RUN_ALIGNMENT:
        # a larger gap holds other tensors' bytes (loaded in their own turn): reading and
        # moving it again would cost more than one more extent
        return False
    return same_dest and delta == job.dest_offset - prev.dest_offset and (delta > 0 or prev.nbytes == 0)


def groups(jobs: Sequence[TensorJob]) -> list[list[TensorJob]]:
    """Consecutive jobs that go to one destination contiguously (mapped tensors: in one
    mapping, separated by less than 4096 bytes of padding; the rest: the same gaps in the
    file as in the destination buffer, less than 4096 bytes unless read in place with
    direct I/O). Every other job is a group of its own."""
    out: list[list[TensorJob]] = []
    for job in jobs:
        if out and _joins(out[-1][-1], job):
            out[-1].append(job)
        else:
            out.append([job])
    return out


def _before(job: TensorJob, pos: int) -> bool:
    """Every byte of ``job`` lies before file offset ``pos`` (a zero-byte tensor: it lies
    before ``pos``, not at it)."""
    end = job.offset + job.nbytes
    return end < pos or (end == pos and job.nbytes > 0)


def _in_place(group: Sequence[TensorJob], alignment: int) -> bool:
    """Direct reads of the group's aligned superset land straight in its host buffer."""
    first = group[0]
    return first.branch == "read" and first.in_place and 1 < alignment <= RUN_ALIGNMENT


def _cut(group: Sequence[TensorJob], pos: int, hi: int, start: int) -> int:
    """``hi`` moved down so that the part of the tensor it falls in ends on a whole
    block (staged chunks are validated on their own); at least one block past ``pos``.
    ``start`` indexes the first job that may contain ``hi``."""
    for job in group[start:]:
        end = job.offset + job.nbytes
        if job.offset < hi < end:
            size = GGML_TYPES_BY_NAME[job.ggml_type].type_size
            cut = job.offset + (hi - job.offset) // size * size
            if cut <= pos:
                cut = min(job.offset + ((pos - job.offset) // size + 1) * size, end)
            return cut
        if job.offset >= hi:
            break
    return hi


def _extents_of(group: Sequence[TensorJob], alignment: int, limits: ExtentLimits, whole: bool) -> list[Extent]:
    first, last = group[0], group[-1]
    branch = first.branch
    begin, end = first.offset, last.offset + last.nbytes
    in_place = _in_place(group, alignment)
    aligned_reads = alignment > 1 and (branch == "staged" or in_place)
    if branch == "lazy" or (whole and branch == "mapped"):
        bounds = [(begin, end)]
    else:
        if branch == "staged":
            biggest = max(GGML_TYPES_BY_NAME[j.ggml_type].type_size for j in group)
            step = max(limits.staging_payload, biggest)
        elif in_place:
            step = align_up(limits.direct_chunk_nbytes, alignment)
        else:
            step = limits.chunk_nbytes
        bounds = []
        count = len(group)
        pos, at, skip = begin, 0, 0
        while pos < end:
            if in_place:
                # interior cuts on block boundaries: neighbouring reads never share a block
                hi = min(align_down(pos, alignment) + step, end)
            else:
                hi = min(pos + step, end)
            if branch == "staged":
                while at < count and group[at].offset + group[at].nbytes <= pos:
                    at += 1
                hi = _cut(group, pos, hi, at)
            bounds.append((pos, hi))
            pos = hi
            # a gap between tensors is not read on its own: the next extent starts at
            # the next tensor
            while skip < count and _before(group[skip], pos):
                skip += 1
            if skip < count and group[skip].offset > pos:
                pos = group[skip].offset
        if not bounds or bounds[-1][1] < end:
            bounds.append((end, end))  # a zero-byte tensor after the last gap
    return _cut_pieces(group, bounds, branch, alignment if aligned_reads else 1)


def _cut_pieces(
    group: Sequence[TensorJob], bounds: list[tuple[int, int]], branch: Branch, alignment: int
) -> list[Extent]:
    """The extents of ``group`` over the file ranges ``bounds`` (in order), each with the
    parts of the tensors it holds; ``alignment`` > 1: their reads are aligned to it."""
    out: list[Extent] = []
    file_index = group[0].file_index
    count = len(group)
    last = len(bounds) - 1
    j = 0
    for n, (lo, hi) in enumerate(bounds):
        pieces: list[Piece] = []
        while j < count:
            job = group[j]
            offset, nbytes = job.offset, job.nbytes
            if nbytes == 0:
                if offset < hi or n == last:
                    pieces.append(Piece(job, offset, offset))
                    j += 1
                    continue
                break
            if offset >= hi:
                break
            job_end = offset + nbytes
            pieces.append(Piece(job, lo if lo > offset else offset, hi if hi < job_end else job_end))
            if job_end > hi:
                break
            j += 1
        if alignment > 1 and hi > lo:  # nothing is read for zero-byte tensors alone
            out.append(
                Extent(
                    branch, file_index, lo, hi, align_down(lo, alignment), align_up(hi, alignment), tuple(pieces), True
                )
            )
        else:
            out.append(Extent(branch, file_index, lo, hi, lo, hi, tuple(pieces), False))
    return out


def plan_extents(
    jobs: Sequence[TensorJob],
    limits: ExtentLimits,
    alignment: Mapping[int, int],
    faulted_ahead: Collection[int] = (),
) -> list[Extent]:
    """The extents that bring in every job's bytes, in load order.

    Args:
        jobs: the tensor jobs, in load order.
        limits: the extent sizes.
        alignment: file index -> block size its direct reads need (1 or absent:
            buffered reads).
        faulted_ahead: files whose mapped bytes a thread of their own faults in
            (:meth:`~service.io.mapping.Mapping.populate_ahead`): each of their mapped
            groups is one extent, as the load only waits for that thread, once, and has
            nothing to step through.

    Returns:
        Extents such that every byte of every tensor lies in exactly one piece (a
        zero-byte tensor: exactly one empty piece); each extent holds the parts of one
        group of :func:`groups`; read ranges of aligned extents (direct reads in place
        or into staging buffers) start and end on the file's block size, and those of
        one group in place share no block.
    """
    out: list[Extent] = []
    for group in groups(jobs):
        file_index = group[0].file_index
        out.extend(_extents_of(group, alignment.get(file_index, 1), limits, file_index in faulted_ahead))
    return out
