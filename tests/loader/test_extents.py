"""The extent planner's properties over generated tensor layouts: every tensor byte in
exactly one piece, one destination per extent, direct-I/O alignment, sizes within the
chunk and the staging buffer, whole blocks in staged chunks; and page-cache routing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.io.align import align_down, align_up
from service.loader.ggml_types import GGML_TYPES_BY_NAME
from service.loader.pipeline.extents import Extent, ExtentLimits, groups, plan_extents
from service.loader.pipeline.layout import TensorJob
from service.loader.pipeline.routing import route


@dataclass(eq=False)
class Dest:
    """A stand-in destination buffer (compared by identity, as the planner does)."""

    name: str


TYPES = ["F32", "F16", "Q8_0", "Q4_K", "Q6_K"]


@st.composite
def layouts(draw: Any) -> tuple[list[TensorJob], ExtentLimits, dict[int, int]]:
    """Tensors laid out in one file, in groups that go to one destination each (some
    contiguous as in the file, some not), with random limits and alignment."""
    jobs: list[TensorJob] = []
    offset = draw(st.integers(0, 9000))
    index = 0
    mapping, lock = Dest("mapping"), None
    for _ in range(draw(st.integers(1, 6))):
        branch = draw(st.sampled_from(["mapped", "read", "copy", "staged", "sync", "lazy"]))
        in_place = draw(st.booleans())
        dest, device = Dest(f"buf{index}"), Dest(f"dev{index}")
        dest_pos = draw(st.integers(0, 4096))
        for _ in range(draw(st.integers(1, 5))):
            ggml_type = draw(st.sampled_from(TYPES))
            size = GGML_TYPES_BY_NAME[ggml_type].type_size
            nbytes = size * draw(st.integers(0, 400))
            if draw(st.integers(0, 9)) == 0:
                dest = Dest(f"other{index}")  # the same branch, another buffer
            jobs.append(
                TensorJob(
                    index, f"t{index}", ggml_type, 0, "m.gguf", offset, nbytes, branch,  # type: ignore[arg-type]
                    mapping=mapping if branch in ("mapped", "lazy", "copy") else None,  # type: ignore[arg-type]
                    dest=None if branch in ("mapped", "lazy") else dest,  # type: ignore[arg-type]
                    dest_offset=dest_pos,
                    device=device if branch in ("staged", "sync") else None,  # type: ignore[arg-type]
                    lock=lock,
                    in_place=in_place,
                )
            )  # fmt: skip
            gap = draw(st.sampled_from([0, 32 - nbytes % 32 if nbytes % 32 else 0, 5, 4096]))
            offset += nbytes + gap
            dest_pos += nbytes + gap
            index += 1
    limits = ExtentLimits(
        chunk_nbytes=draw(st.integers(1, 20000)),
        direct_chunk_nbytes=draw(st.integers(1, 20000)),
        staging_payload=draw(st.integers(4096, 20000)),
    )
    alignment = draw(st.sampled_from([1, 512, 4096]))
    return jobs, limits, {0: alignment}


def _dest_of(job: TensorJob) -> tuple[Any, ...]:
    return (job.branch, id(job.mapping), id(job.dest), id(job.device), job.branch == "read" and job.in_place)


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_every_tensor_byte_is_in_exactly_one_piece(
    layout: tuple[list[TensorJob], ExtentLimits, dict[int, int]],
) -> None:
    jobs, limits, alignment = layout
    extents = plan_extents(jobs, limits, alignment)
    covered: dict[int, list[tuple[int, int]]] = {j.index: [] for j in jobs}
    for e in extents:
        for p in e.pieces:
            covered[p.job.index].append((p.lo, p.hi))
    for job in jobs:
        parts = sorted(covered[job.index])
        if job.nbytes == 0:
            assert parts == [(job.offset, job.offset)]
            continue
        assert all(hi > lo for lo, hi in parts)
        assert parts[0][0] == job.offset and parts[-1][1] == job.offset + job.nbytes
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:], strict=False))  # no gap, no overlap
    # load order is kept: the pieces in extent order follow the jobs
    order = [p.job.index for e in extents for p in e.pieces]
    assert order == sorted(order)


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_each_extent_has_one_destination_and_fits_it(
    layout: tuple[list[TensorJob], ExtentLimits, dict[int, int]],
) -> None:
    jobs, limits, alignments = layout
    a = alignments[0]
    for e in plan_extents(jobs, limits, alignments):
        assert e.pieces
        assert len({_dest_of(p.job) for p in e.pieces}) == 1
        assert all(e.lo <= p.lo <= p.hi <= e.hi for p in e.pieces)
        if e.branch in ("read", "copy", "staged"):
            # the extent's bytes lie in its destination as in the file
            for p in e.pieces:
                assert p.job.dest_offset + (p.lo - p.job.offset) == e.dest_offset + (p.lo - e.lo)
        if e.branch in ("sync", "lazy"):
            assert len({p.job.index for p in e.pieces}) == 1
        if e.lo == e.hi:  # zero-byte tensors alone: nothing to read
            assert (e.read_lo, e.read_hi) == (e.lo, e.hi) and not e.aligned
            assert all(p.lo == p.hi for p in e.pieces)
            continue
        if e.aligned:
            assert a > 1 and e.read_lo % a == 0 and e.read_hi % a == 0
            assert e.read_lo == align_down(e.lo, a) and e.read_hi == align_up(e.hi, a)
        else:
            assert (e.read_lo, e.read_hi) == (e.lo, e.hi)
        if e.branch == "staged":
            assert e.aligned == (a > 1)
            assert e.read_hi - e.read_lo <= limits.staging_payload + (2 * a if a > 1 else 0)
            for p in e.pieces:  # staged chunks carry whole blocks (validated on their own)
                size = GGML_TYPES_BY_NAME[p.job.ggml_type].type_size
                assert p.completes or (p.hi - p.job.offset) % size == 0
        elif e.branch == "read" and e.first.in_place and a > 1:
            assert e.aligned and e.hi - align_down(e.lo, a) <= align_up(limits.direct_chunk_nbytes, a)
        elif e.branch != "lazy":
            assert not e.aligned and e.hi - e.lo <= limits.chunk_nbytes


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_mapped_runs_faulted_in_ahead_are_one_extent_each(
    layout: tuple[list[TensorJob], ExtentLimits, dict[int, int]],
) -> None:
    jobs, limits, alignments = layout
    stepped = plan_extents(jobs, limits, alignments)
    whole = plan_extents(jobs, limits, alignments, faulted_ahead={0})

    # the other branches are cut as before; each mapped run of adjacent tensors is one
    # extent from its first byte to its last
    def shape(e: Extent) -> tuple[Any, ...]:
        return (e.branch, e.lo, e.hi, e.read_lo, e.read_hi, e.aligned, [(p.job.index, p.lo, p.hi) for p in e.pieces])

    assert [shape(e) for e in whole if e.branch != "mapped"] == [shape(e) for e in stepped if e.branch != "mapped"]
    runs = [g for g in groups(jobs) if g[0].branch == "mapped"]
    mapped = [e for e in whole if e.branch == "mapped"]
    assert [[p.job.index for p in e.pieces] for e in mapped] == [[j.index for j in run] for run in runs]
    for e, run in zip(mapped, runs, strict=True):
        assert (e.lo, e.hi) == (run[0].offset, run[-1].offset + run[-1].nbytes)
        assert all(p.lo == p.job.offset and p.hi == p.job.offset + p.job.nbytes for p in e.pieces)


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_reads_in_place_never_share_a_block(layout: tuple[list[TensorJob], ExtentLimits, dict[int, int]]) -> None:
    jobs, limits, alignments = layout
    by_dest: dict[int, list[Extent]] = {}
    for e in plan_extents(jobs, limits, alignments):
        if e.aligned and e.branch == "read":
            by_dest.setdefault(id(e.first.dest), []).append(e)
    for extents in by_dest.values():
        # consecutive reads of one run may be in flight together: their blocks are disjoint
        runs = sorted(extents, key=lambda e: e.lo)
        for prev, nxt in zip(runs, runs[1:], strict=False):
            if nxt.dest_offset - prev.dest_offset == nxt.lo - prev.lo:
                assert prev.read_hi <= nxt.read_lo


def test_consecutive_tensors_contiguous_in_one_buffer_share_extents() -> None:
    dest = Dest("buf")
    jobs = [
        TensorJob(i, f"t{i}", "F32", 0, "m.gguf", 1000 + 64 * i, 64, "read", dest=dest, dest_offset=64 * i)  # type: ignore[arg-type]
        for i in range(10)
    ]
    extents = plan_extents(jobs, ExtentLimits(256, 1 << 20, 1 << 20), {})
    assert [(e.lo, e.hi) for e in extents] == [(1000 + 256 * k, 1000 + 256 * (k + 1)) for k in range(2)] + [
        (1512, 1640)
    ]
    assert [len(e.pieces) for e in extents] == [4, 4, 2]
    other = [*jobs[:5], TensorJob(5, "t5", "F32", 0, "m.gguf", 1320, 64, "read", dest=Dest("b2"))]  # type: ignore[arg-type]
    assert len({id(e.first.dest) for e in plan_extents(other, ExtentLimits(1 << 20, 1 << 20, 1 << 20), {})}) == 2


@pytest.mark.parametrize("branch", ["staged", "read", "copy"])
def test_an_extent_never_reads_another_tensors_bytes(branch: str) -> None:
    # a buffer laid out as the file, loaded out of file order (biggest first): the small
    # tensor between the two big ones is the same distance apart in the file and in the
    # buffer, but it is not read (and moved) with them: it has its own turn
    dest = Dest("buf")
    sizes = [(0, 64 << 10), (64 << 10, 8 << 10), (72 << 10, 64 << 10)]
    jobs = [
        TensorJob(i, f"t{i}", "F32", 0, "m.gguf", 4096 + off, n, branch, dest=dest, dest_offset=off)  # type: ignore[arg-type]
        for i, (off, n) in enumerate(sizes)
    ]
    ordered = [jobs[0], jobs[2], jobs[1]]
    for alignment in (1, 4096):
        extents = plan_extents(ordered, ExtentLimits(1 << 20, 1 << 20, 1 << 20), {0: alignment})
        assert sum(e.hi - e.lo for e in extents) == sum(n for _, n in sizes)  # every byte once
        assert sorted(p.job.index for e in extents for p in e.pieces) == [0, 1, 2]
    # in file order the three are one run: one extent
    assert len(plan_extents(jobs, ExtentLimits(1 << 20, 1 << 20, 1 << 20), {})) == 1


def test_routing_reads_resident_stretches_buffered() -> None:
    page = 4096
    pages = np.zeros(1024, dtype=bool)  # 4 MiB
    pages[256:768] = True  # 2 MiB resident in the middle
    pages[100] = True  # a lone resident page: not worth a read of its own
    segments = route(pages, 0, 1024 * page, 4096, min_run=1 << 20)
    assert [(s.lo, s.hi, s.buffered) for s in segments] == [
        (0, 256 * page, False),
        (256 * page, 768 * page, True),
        (768 * page, 1024 * page, False),
    ]
    # every page resident, or none: one segment
    assert [s.buffered for s in route(np.ones(8, dtype=bool), 0, 8 * page, 4096)] == [True]
    assert [s.buffered for s in route(np.zeros(8, dtype=bool), 0, 8 * page, 4096)] == [False]
    # blocks bigger than a page are resident only when all of their pages are
    mixed = np.array([True, False] * 8)
    assert [s.buffered for s in route(mixed, 0, 16 * page, 8192, min_run=1)] == [False]
