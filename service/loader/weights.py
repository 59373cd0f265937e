"""The weights index: every tensor of a model by name, with the file, absolute offset and
size of its data (llama.cpp's ``weights_map`` of ``llama_tensor_weight``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import cached_property

from service.errors import TensorBoundsError
from service.loader.gguf import GGUFFile, TensorInfo, read_gguf

_LAYER = re.compile(r"blk\.[ \t\n\r\f\v]*([+-]?\d+)\.")


def layer_of(name: str) -> int:
    """The layer number in a ``blk.N.`` tensor name, or -1 (llama.cpp's
    ``weight_name_comparer`` reads it with ``sscanf("blk.%d.")``)."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else -1


def load_order_key(name: str) -> tuple[int, str]:
    """Sort key of the load order: by layer number (numeric), then by name."""
    return (layer_of(name), name)


@dataclass(frozen=True, slots=True)
class TensorWeight:
    """Where one tensor's data lives.

    Attributes:
        name: the tensor name.
        file_index: index of the file (split) holding the data.
        offset: absolute byte offset of the data in that file.
        nbytes: size of the data in bytes.
        info: the tensor info (ne, ggml type, ...).
    """

    name: str
    file_index: int
    offset: int
    nbytes: int
    info: TensorInfo

    @property
    def end(self) -> int:
        """Absolute byte offset just past the data."""
        return self.offset + self.nbytes


class WeightIndex:
    """All tensors of a model, merged over its files, in load order.

    Attributes:
        files: the parsed GGUF files; ``files[0]`` holds the model's metadata.
        weights: tensor name -> :class:`TensorWeight`, ordered by layer number then name.
    """

    def __init__(self, files: list[GGUFFile]) -> None:
        self.files = files
        found: dict[str, TensorWeight] = {}
        for file_index, gguf_file in enumerate(files):
            for info in gguf_file.tensors:
                found[info.name] = _weight(gguf_file, file_index, info)
        self.weights = {name: found[name] for name in sorted(found, key=load_order_key)}

    @property
    def path(self) -> str:
        """The model's first (or only) file."""
        return self.files[0].path

    @property
    def metadata(self) -> GGUFFile:
        """The file holding the model's KV metadata (the first split)."""
        return self.files[0]

    @property
    def byte_order(self) -> str:
        """``"little"`` or ``"big"`` (of the first file)."""
        return self.files[0].byte_order

    @cached_property
    def nbytes(self) -> int:
        """Total tensor data in bytes (``n_bytes``, without padding)."""
        return sum(w.nbytes for w in self.weights.values())

    @cached_property
    def n_elements(self) -> int:
        """Total number of elements over all tensors."""
        return sum(w.info.n_elements for w in self.weights.values())

    @property
    def bpw(self) -> float:
        """Bits per weight: ``nbytes * 8 / n_elements`` (0 for an empty model)."""
        return self.nbytes * 8 / self.n_elements if self.n_elements else 0.0

    def __len__(self) -> int:
        return len(self.weights)

    def __getitem__(self, name: str) -> TensorWeight:
        return self.weights[name]


def _weight(gguf_file: GGUFFile, file_index: int, info: TensorInfo) -> TensorWeight:
    """The weight of ``info`` in ``gguf_file``, checked to lie inside the file
    (``llama_tensor_weight``: ``offs + nbytes`` neither overflows nor passes the end)."""
    offset = gguf_file.data_offset + info.offset
    end = offset + info.nbytes
    if end >= 1 << 64 or end > gguf_file.file_size:
        raise TensorBoundsError(
            f"tensor '{info.name}' data [{offset}, {end}) ends past the end of the file ({gguf_file.file_size} bytes)",
            path=gguf_file.path,
            tensor=info.name,
            offset=offset,
            hint="the file is corrupted or incomplete (an interrupted download?)",
        )
    return TensorWeight(info.name, file_index, offset, info.nbytes, info)


def open_model(path: str | os.PathLike[str]) -> WeightIndex:
    """Parse the GGUF model at ``path`` and index its tensors.

    Args:
        path: the model file.

    Returns:
        The :class:`WeightIndex`.

    Raises:
        StorageError: the file cannot be opened or read.
        FormatError: the file is not valid GGUF, or a tensor's data lies outside it.
    """
    return WeightIndex([read_gguf(path)])
