"""The read branch tells a host buffer's touch helper where the reads have reached."""

from __future__ import annotations

import asyncio
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from service.loader.devices.base import HostBuffer
from service.loader.pipeline import LoadOptions, load_model
from service.loader.weights import open_model
from tests.helpers import write_fixture


@pytest.mark.parametrize("reads", [1, 2])
@pytest.mark.parametrize("mode", ["none", "direct-io"])
def test_reads_report_their_position_to_the_buffer_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reads: int, mode: str
) -> None:
    rng = np.random.default_rng(3)
    tensors = {f"blk.{i}.w": (rng.standard_normal((64, 1000 + i)).astype(np.float32), Q.F32) for i in range(6)}
    write_fixture(tmp_path / "m.gguf", tensors=tensors)
    reached: list[tuple[int, int]] = []
    original = HostBuffer.reads_reached

    def record(self: HostBuffer, offset: int) -> None:
        reached.append((id(self), offset))
        original(self, offset)

    monkeypatch.setattr(HostBuffer, "reads_reached", record)
    options = LoadOptions(chunk_nbytes=64 << 10, direct_chunk_nbytes=64 << 10, reads_in_flight=reads)
    index = open_model(tmp_path / "m.gguf")
    with asyncio.run(load_model(index, load_mode=mode, options=options)) as model:
        theirs = {t.name: bytes(t.data.tobytes()) for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
        assert {t.name: np.asarray(t.data).tobytes() for t in model} == theirs
        nbytes = sum(len(v) for v in theirs.values())
    # every extent after the first is announced, in buffer order, inside the buffer
    offsets = [off for _, off in reached]
    assert len({b for b, _ in reached}) == 1
    assert len(offsets) >= nbytes // (64 << 10) - 1
    assert offsets == sorted(offsets) and 0 < offsets[0] and offsets[-1] < nbytes + 8192
