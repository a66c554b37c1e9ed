"""Lazy reads from a safetensors checkpoint as models ship it: ``model.safetensors.index.json`` (its
``weight_map``: tensor name → shard file) plus the shards, or a single ``.safetensors`` file.

Nothing is read until asked: the index lists names, a shard's header their dtypes, shapes and byte offsets;
``read`` returns one tensor, or a range of its first dim, as a new CPU tensor. Each shard's header is validated
with ``safetensors.safe_open`` (huggingface.co/docs/safetensors; the format: an 8-byte little-endian header length,
the JSON header, then the data), and the asked bytes are read from the file straight into the returned tensor.
Not through the library's own ``get_slice``: it maps the shard and copies out of the mapping, and the mapped pages
it touches (whole large folios on recent kernels, megabytes per touch) stay in the process's resident memory until
the shard is closed — measured, they took a rank's peak to 1.9–2.7× its own experts' bytes.

Every error names the tensor and the file: a name no shard holds (the index, or the file, that was searched), an
index entry whose shard lacks it, a dtype or shape other than the caller expects.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# safetensors' dtype names (the header's "dtype" field) → torch dtypes this package reads.
_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E8M0": torch.float8_e8m0fnu,
    "U8": torch.uint8,
    "I8": torch.int8,
}


def _safe_open(path: str):
    from safetensors import safe_open  # a dependency of transformers; needed only when a checkpoint is read

    return safe_open(path, framework="pt", device="cpu")


class ShardedSafetensors:
    """A safetensors checkpoint read lazily. ``path``: a directory holding ``model.safetensors.index.json`` (or a
    single ``model.safetensors``), an index file, or one ``.safetensors`` file.

    Use as a context manager, or call :meth:`close`."""

    def __init__(self, path: str | os.PathLike):
        path = os.fspath(path)
        if os.path.isdir(path):
            index = os.path.join(path, INDEX_NAME)
            single = os.path.join(path, SINGLE_NAME)
            if os.path.isfile(index):
                path = index
            elif os.path.isfile(single):
                path = single
            else:
                raise FileNotFoundError(f"{path}: neither {INDEX_NAME} nor {SINGLE_NAME} is in this directory")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no such checkpoint file")
        self.source = path
        self._open: dict[str, object] = {}
        self._headers: dict[str, tuple[dict, int]] = {}
        if path.endswith(".json"):
            with open(path) as f:
                try:
                    weight_map = json.load(f)["weight_map"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f'{path}: not a safetensors index (no readable "weight_map"): {e}') from None
            root = os.path.dirname(path)
            self._file_of = {k: os.path.join(root, v) for k, v in weight_map.items()}
        else:
            with _safe_open(path) as f:
                self._file_of = dict.fromkeys(f.keys(), path)

    # --- names ---------------------------------------------------------------------------------------------------
    def keys(self) -> Iterator[str]:
        return iter(self._file_of)

    def __contains__(self, key: str) -> bool:
        return key in self._file_of

    def file_of(self, key: str) -> str:
        """The shard holding ``key``; KeyError naming the key and the index (or file) searched."""
        try:
            return self._file_of[key]
        except KeyError:
            raise KeyError(f"{key}: no such tensor in {self.source}") from None

    # --- reads ---------------------------------------------------------------------------------------------------
    def _header(self, file: str) -> tuple[dict, int]:
        """(tensor name → {dtype, shape, data_offsets}, offset of the data) of one shard, read once.

        The header is validated by ``safetensors.safe_open`` (offsets in range and contiguous, dtypes known) and
        then parsed here, as the format defines it (an 8-byte little-endian length, then that much JSON; offsets
        relative to the end of the header), so that data can be read with plain file reads."""
        got = self._headers.get(file)
        if got is None:
            if not os.path.isfile(file):
                raise FileNotFoundError(f"{file}: shard named by {self.source} does not exist")
            with _safe_open(file):
                pass
            with open(file, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            got = self._headers[file] = (header, 8 + n)
        return got

    def _entry(self, key: str) -> tuple[dict, int, str]:
        file = self.file_of(key)
        header, data_start = self._header(file)
        if key not in header:
            raise KeyError(f"{key}: {self.source} maps it to {file}, which does not hold it")
        return header[key], data_start, file

    def info(self, key: str) -> tuple[torch.dtype, tuple[int, ...], str]:
        """(dtype, shape, file) of ``key`` from the shard's header; no data is read."""
        e, _, file = self._entry(key)
        if e["dtype"] not in _DTYPES:
            raise TypeError(f"{key} in {file}: dtype {e['dtype']} is not one this loader reads ({', '.join(_DTYPES)})")
        return _DTYPES[e["dtype"]], tuple(e["shape"]), file

    def read(self, key: str, first: int | None = None, count: int | None = None) -> torch.Tensor:
        """``key`` as a new CPU tensor, or its rows ``first … first+count−1`` along dim 0 (only those are read).

        The bytes go straight from the file into the tensor's memory (one ``readinto``): no mapping of the shard,
        no intermediate copy, so a read costs the process exactly the tensor it returns."""
        dtype, shape, file = self.info(key)
        e, data_start, _ = self._entry(key)
        begin, end = e["data_offsets"]
        if first is not None:
            if not shape or first < 0 or count < 0 or first + count > shape[0]:
                raise ValueError(f"{key} in {file}: rows {first}…{first + count - 1} of shape {list(shape)}")
            row = (end - begin) // shape[0] if shape[0] else 0
            begin, end, shape = begin + first * row, begin + (first + count) * row, (count, *shape[1:])
        out = torch.empty(shape, dtype=dtype)
        nbytes = end - begin
        if nbytes != out.numel() * out.element_size():
            raise ValueError(f"{key} in {file}: {nbytes} bytes for shape {list(shape)} of {dtype}")
        if nbytes:
            f = self._file(file)
            f.seek(data_start + begin)
            view = memoryview(out.view(torch.uint8).reshape(-1).numpy()).cast("B")
            got = f.readinto(view)
            if got != nbytes:
                raise ValueError(f"{key} in {file}: the file ends {nbytes - got} bytes early (truncated shard)")
        return out

    def _file(self, file: str):
        f = self._open.get(file)
        if f is None:
            f = self._open[file] = open(file, "rb", buffering=0)
        return f

    def _drop(self, file: str) -> None:
        f = self._open.pop(file, None)
        if f is not None:
            f.close()

    def close(self) -> None:
        for file in list(self._open):
            self._drop(file)

    def __enter__(self) -> ShardedSafetensors:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
