"""Split models: found from the first split, merged into one weights index, loaded
byte-identical to the single file; every split error named."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from service.errors import SplitError
from service.loader.pipeline import load_model
from service.loader.weights import open_model, split_path, split_prefix
from tests.helpers import Fixture, split_gguf
from tests.samples import FACTS


def test_split_names() -> None:
    assert split_path("/m/model", 0, 3) == "/m/model-00001-of-00003.gguf"
    assert split_prefix("/m/model-00002-of-00003.gguf", 1, 3) == "/m/model"
    assert split_prefix("/m/model-00002-of-00003.gguf", 0, 3) is None
    assert split_prefix("-00001-of-00003.gguf", 0, 3) is None


def _same_model(single: Path, first_split: Path, mode: str) -> None:
    a = open_model(single)
    b = open_model(first_split)
    assert list(a.weights) == list(b.weights)
    assert a.metadata.kv.keys() - b.metadata.kv.keys() == set()
    assert b.metadata.kv.keys() - a.metadata.kv.keys() == {"split.no", "split.count", "split.tensors.count"}
    with asyncio.run(load_model(a, load_mode=mode)) as ma, asyncio.run(load_model(b, load_mode=mode)) as mb:
        for name in a.weights:
            assert ma[name].data.tobytes() == mb[name].data.tobytes(), name
            assert ma[name].ne == mb[name].ne and ma[name].ggml_type == mb[name].ggml_type


@pytest.mark.parametrize("mode", ["mmap", "none"])
def test_fixture_split_loads_like_the_single_file(tmp_path: Path, all_types_fixture: Fixture, mode: str) -> None:
    paths = split_gguf(all_types_fixture.path, tmp_path / "m", [3, 1, 3])
    index = open_model(paths[0])
    assert len(index.files) == 3
    assert [f.path for f in index.files] == [str(p) for p in paths]
    # each split has its own data offset
    assert len({f.data_offset for f in index.files}) == 3
    _same_model(all_types_fixture.path, paths[0], mode)


@pytest.mark.sample
@pytest.mark.parametrize("mode", ["mmap", "none"])
def test_sample_split_in_three_loads_like_the_single_file(
    tmp_path: Path, sample_name: str, sample_path: Path, mode: str
) -> None:
    n = FACTS[sample_name].n_tensors
    paths = split_gguf(sample_path, tmp_path / sample_name, [100, 100, n - 200])
    index = open_model(paths[0])
    assert [len(f.tensors) for f in index.files] == [100, 100, n - 200]
    assert len(index) == n
    _same_model(sample_path, paths[0], mode)


def test_split_errors(tmp_path: Path, all_types_fixture: Fixture) -> None:
    paths = split_gguf(all_types_fixture.path, tmp_path / "m", [3, 2, 2])
    with pytest.raises(SplitError, match="split 3 of 3"):
        open_model(paths[2])
    renamed = tmp_path / "renamed.gguf"
    shutil.copyfile(paths[0], renamed)
    with pytest.raises(SplitError, match="must be named PREFIX-00001-of-00003.gguf"):
        open_model(renamed)
    paths[1].rename(tmp_path / "away.gguf")
    with pytest.raises(SplitError) as info:
        open_model(paths[0])
    assert f"split 2 of 3 is missing: {paths[1]}" in str(info.value)


def test_tensor_in_two_splits(tmp_path: Path, all_types_fixture: Fixture) -> None:
    paths = split_gguf(all_types_fixture.path, tmp_path / "m", [4, 3])
    other = split_gguf(all_types_fixture.path, tmp_path / "n", [3, 4])
    shutil.copyfile(other[1], paths[1])  # the second split now repeats a tensor of the first
    with pytest.raises(SplitError, match="is duplicated: it is also in"):
        open_model(paths[0])


def test_misnumbered_sibling(tmp_path: Path, all_types_fixture: Fixture) -> None:
    paths = split_gguf(all_types_fixture.path, tmp_path / "m", [3, 2, 2])
    shutil.copyfile(paths[2], paths[1])
    with pytest.raises(SplitError, match="split.no is 2, expected 1"):
        open_model(paths[0])


def test_splits_of_different_byte_order(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    from tests.helpers import write_fixture

    f32 = gguf.GGMLQuantizationType.F32
    V = gguf.GGUFValueType
    for i, (name, endian) in enumerate([("a", gguf.GGUFEndian.LITTLE), ("b", gguf.GGUFEndian.BIG)]):
        write_fixture(
            tmp_path / f"m-{i + 1:05d}-of-00002.gguf",
            kv=[("split.no", i, V.UINT16, None), ("split.count", 2, V.UINT16, None),
                ("split.tensors.count", 2, V.INT32, None)],
            tensors={name: (np.arange(8, dtype=np.float32), f32)},
            endian=endian,
        )  # fmt: skip
    with pytest.raises(SplitError, match="split 2 is big-endian but the first split is little-endian"):
        open_model(tmp_path / "m-00001-of-00002.gguf")


def test_sibling_outside_the_root_is_not_opened(tmp_path: Path, all_types_fixture: Fixture) -> None:
    root = tmp_path / "root"
    root.mkdir()
    paths = split_gguf(all_types_fixture.path, tmp_path / "m", [3, 4])
    shutil.copyfile(paths[0], root / paths[0].name)
    (root / paths[1].name).symlink_to(paths[1])
    assert len(open_model(root / paths[0].name)) == 7
    with pytest.raises(SplitError, match="leaves the models directory"):
        open_model(root / paths[0].name, root=str(root))
