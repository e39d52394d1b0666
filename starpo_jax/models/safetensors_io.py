"""Memory-mapped reading and sharded writing of safetensors files (numpy, bfloat16 included).

The format is an 8-byte little-endian header length, a JSON header mapping each
tensor name to ``dtype``, ``shape`` and ``data_offsets``, then the raw data.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterable, NamedTuple

import ml_dtypes
import numpy as np

DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
INDEX_FILE = "model.safetensors.index.json"


class TensorInfo(NamedTuple):
    """Where one tensor lives: file, dtype, shape and byte offset of its data."""

    file: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int


class SafetensorsIndex:
    """Name -> tensor over one or many safetensors files, read lazily through ``np.memmap``."""

    def __init__(self, files: Iterable[Path]):
        self.tensors: dict[str, TensorInfo] = {}
        self._maps: dict[Path, np.memmap] = {}
        for file in files:
            for name, info in read_header(file).items():
                if name in self.tensors:
                    raise ValueError(f"tensor {name!r} appears in both {self.tensors[name].file} and {file}")
                self.tensors[name] = info

    @classmethod
    def from_folder(cls, folder: Path) -> "SafetensorsIndex":
        """Uses ``model.safetensors.index.json`` when present, else every ``*.safetensors`` file."""
        index = folder / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index} has no 'weight_map'")
            files = sorted({folder / f for f in weight_map.values()})
            missing = [str(f) for f in files if not f.is_file()]
            if missing:
                raise FileNotFoundError(f"{index} lists shard file(s) that do not exist: {', '.join(missing)}")
            result = cls(files)
            absent = sorted(k for k, f in weight_map.items() if k not in result.tensors)
            if absent:
                raise KeyError(f"{index} maps key(s) {absent[:5]} to shards that do not hold them")
            return result
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors file and no {INDEX_FILE} in {folder}")
        return cls(files)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str) -> np.ndarray:
        """A read-only array view of tensor ``name`` (no copy until used)."""
        info = self.tensors[name]
        if info.file not in self._maps:
            self._maps[info.file] = np.memmap(info.file, dtype=np.uint8, mode="r")
        size = int(np.prod(info.shape, dtype=np.int64)) * info.dtype.itemsize
        raw = self._maps[info.file][info.offset:info.offset + size]
        return raw.view(info.dtype).reshape(info.shape)


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Parses the JSON header of one safetensors file.

    Raises ``ValueError`` naming the file (and the tensor) for a truncated or corrupt file: a header
    or tensor data that reaches past the end of the file, an entry whose byte range does not hold its
    shape and dtype, or an unsupported dtype.
    """
    size = Path(file).stat().st_size
    with open(file, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{file} is not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", prefix)
        if length > size - 8:
            raise ValueError(f"{file} is truncated or not a safetensors file: its header claims {length} bytes, "
                             f"the file has {size}")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{file} has a corrupt safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file} has a corrupt safetensors header: not a JSON object")
    start = 8 + length
    result = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{file}: tensor {name!r} has a malformed header entry {entry!r}") from None
        if dtype not in DTYPES:
            raise ValueError(f"{file}: tensor {name!r} has unsupported dtype {dtype}")
        if end - begin != int(np.prod(shape, dtype=np.int64)) * np.dtype(DTYPES[dtype]).itemsize or begin < 0:
            raise ValueError(f"{file}: tensor {name!r} of shape {shape} and dtype {dtype} has a byte range "
                             f"[{begin}, {end}) of the wrong size")
        if start + end > size:
            raise ValueError(f"{file} is truncated: tensor {name!r} ends at byte {start + end}, the file has {size}")
        result[name] = TensorInfo(file, np.dtype(DTYPES[dtype]), shape, start + begin)
    return result


def write_file(file: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Writes ``tensors`` to one safetensors file."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    arrays = {}
    for name, array in tensors.items():
        array = np.ascontiguousarray(array)
        header[name] = {"dtype": NAMES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        arrays[name] = array
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for array in arrays.values():
            f.write(array.tobytes())


def write_sharded(folder: Path, tensors: dict[str, np.ndarray], max_shard_bytes: int) -> None:
    """Writes ``model.safetensors``, or numbered shards plus the index when over ``max_shard_bytes``."""
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, array in tensors.items():
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    if len(shards) == 1:
        write_file(folder / "model.safetensors", shards[0])
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_file(folder / name, shard)
        weight_map.update({key: name for key in shard})
    total = sum(a.nbytes for a in tensors.values())
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
