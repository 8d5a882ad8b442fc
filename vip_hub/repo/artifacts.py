"""Digests of repo files, and safetensors headers read and rewritten without torch (importing
this module does not import it: the hub's processes digest and verify files without torch).

A weights digest (``tensors-sha256:``) covers tensor names, dtypes, shapes and bytes but
not the header's metadata, so the ledger kept in that metadata can name the digest of the
very file it lives in.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
import numpy.typing as npt

from ..errors import SafetensorsError
from ..repo_format import is_weights_file

if TYPE_CHECKING:
    import torch

__all__ = [
    "SafetensorsError",
    "bytes_sha256",
    "digest_file",
    "file_sha256",
    "loaded_tensors_digest",
    "nonfinite_count",
    "nonfinite_in_file",
    "nonfinite_problem",
    "header_metadata",
    "header_tensors",
    "read_safetensors_header",
    "CHUNK",
    "git_blob_hasher",
    "git_blob_id",
    "read_safetensors_metadata",
    "rewrite_safetensors_metadata",
    "tensors_digest",
    "tensors_digest_of",
]

CHUNK = 1 << 20
"""The bytes a file is read by when it is hashed or copied."""
_METADATA = "__metadata__"  # the safetensors header's one non-tensor entry
MAX_HEADER_BYTES = 100 * 1024 * 1024
_ST_DTYPES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}  # the safetensors format's dtype names, and torch's name of each


def bytes_sha256(data: bytes) -> str:
    """``sha256:<hex>`` of ``data``: the digest ``file_sha256`` gives a file holding it."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def file_sha256(path: str | os.PathLike[str]) -> str:
    """``sha256:<hex>`` of the file's bytes."""
    with open(path, "rb") as f:
        return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()


def git_blob_hasher(size: int) -> hashlib._Hash:
    """The SHA-1 git names a blob of ``size`` bytes by, its header fed: feed it the bytes."""
    return hashlib.sha1(f"blob {size}\0".encode(), usedforsecurity=False)


def git_blob_id(path: str | os.PathLike[str]) -> str:
    """The git blob id (hex SHA-1 of ``blob <size>\\0`` and the bytes) of a file."""
    size = os.stat(path).st_size
    with open(path, "rb") as f:
        return hashlib.file_digest(f, lambda: git_blob_hasher(size)).hexdigest()


def read_safetensors_header(path: str | os.PathLike[str]) -> tuple[dict[str, Any], int]:
    """The parsed JSON header (tensor entries plus ``__metadata__``) and its byte length."""
    with open(path, "rb") as f:
        return _read_header(f, os.fstat(f.fileno()).st_size, str(path))


def read_safetensors_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """A safetensors file's ``__metadata__`` (empty when it has none)."""
    return header_metadata(read_safetensors_header(path)[0])


def header_metadata(header: Mapping[str, Any]) -> dict[str, str]:
    """A parsed safetensors header's ``__metadata__`` (empty when it has none)."""
    return dict(header.get(_METADATA) or {})


def header_tensors(header: Mapping[str, Any]) -> dict[str, Any]:
    """A safetensors header's tensor entries by name (its metadata left out), sorted by name."""
    return {k: header[k] for k in sorted(header) if k != _METADATA}


def _read_header(f: BinaryIO, file_size: int, name: str) -> tuple[dict[str, Any], int]:
    raw = f.read(8)
    if len(raw) != 8:
        raise SafetensorsError(f"{name}: too short to be a safetensors file")
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_HEADER_BYTES or 8 + n > file_size:
        raise SafetensorsError(
            f"{name}: header length {n} is impossible for a {file_size}-byte file"
        )
    try:
        header = json.loads(f.read(n))
    except (ValueError, RecursionError) as e:
        raise SafetensorsError(f"{name}: header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{name}: header is not a JSON object")
    data_size = file_size - 8 - n
    for key, entry in header.items():
        if key == _METADATA:
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise SafetensorsError(f"{name}: {_METADATA} must map strings to strings")
            continue
        try:
            start, end = entry["data_offsets"]
            shape = entry["shape"]
            ok = (
                entry["dtype"] in _ST_DTYPES
                and type(start) is type(end) is int
                and 0 <= start <= end <= data_size
                and isinstance(shape, list)
                and all(type(d) is int and d >= 0 for d in shape)
            )
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise SafetensorsError(f"{name}: tensor entry {key!r} is malformed or out of bounds")
    return header, n


def tensors_digest(path: str | os.PathLike[str]) -> str:
    """``tensors-sha256:<hex>`` over the tensors of a safetensors file (metadata excluded)."""
    with open(path, "rb") as f:
        header, n = _read_header(f, os.fstat(f.fileno()).st_size, str(path))
        h = hashlib.sha256()
        for key, entry in header_tensors(header).items():
            _update_entry(h, key, entry["dtype"], entry["shape"])
            for chunk in _entry_chunks(f, n, entry):
                h.update(chunk)
            if f.tell() < 8 + n + entry["data_offsets"][1]:
                raise SafetensorsError(f"{path}: truncated tensor data for {key!r}")
    return "tensors-sha256:" + h.hexdigest()


def _entry_chunks(f: BinaryIO, n: int, entry: Mapping[str, Any]) -> Iterator[bytes]:
    """The data of tensor ``entry`` of the safetensors file ``f`` (header of ``n`` bytes) in
    reads of at most ``CHUNK`` bytes (whole elements: a power of two), up to where it ends or
    the file does."""
    start, end = entry["data_offsets"]
    f.seek(8 + n + start)
    remaining = end - start
    while remaining and (chunk := f.read(min(CHUNK, remaining))):
        yield chunk
        remaining -= len(chunk)


def tensors_digest_of(tensors: Mapping[str, torch.Tensor]) -> str:
    """The same digest as :func:`tensors_digest`, for tensors in memory (before saving)."""
    h = hashlib.sha256()
    for key in sorted(tensors):
        dtype, data = _stored(tensors[key])
        _update_entry(h, key, dtype, list(tensors[key].shape))
        h.update(data.tobytes())
    return "tensors-sha256:" + h.hexdigest()


def loaded_tensors_digest(
    tensors: Mapping[str, torch.Tensor], header: Mapping[str, Any]
) -> str | None:
    """:func:`tensors_digest_of` of the tensors ``header`` (a safetensors header) names, taken
    from ``tensors`` (e.g. a model's state dict) cast back to its dtypes; None when one is missing
    or the cast would change a value (it holds what no file of those dtypes stores)."""
    import torch

    stored = {}
    for key in header_tensors(header):
        if key not in tensors or header[key].get("dtype") not in _ST_DTYPES:
            return None
        t = tensors[key].detach().cpu()
        s = t.to(getattr(torch, _ST_DTYPES[header[key]["dtype"]]))
        if s.dtype != t.dtype and not torch.equal(
            s.to(t.dtype).reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)
        ):
            return None
        stored[key] = s
    return tensors_digest_of(stored)


def _stored(tensor: torch.Tensor) -> tuple[str, npt.NDArray[np.uint8]]:
    """``tensor``'s safetensors dtype and the bytes a weights file stores for it."""
    import torch

    names = {getattr(torch, t): st for st, t in _ST_DTYPES.items()}
    t = tensor.detach().cpu().contiguous()
    return names[t.dtype], t.reshape(-1).view(torch.uint8).numpy()


def _update_entry(h: Any, key: str, dtype: str, shape: list[int]) -> None:
    h.update(json.dumps([key, dtype, list(shape)]).encode())


def digest_file(path: str | os.PathLike[str], name: str | None = None) -> str:
    """The digest a ledger records for a file: the tensors digest when its repo path ``name``
    (default: ``path``) is a weights file (``is_weights_file``), else its sha256."""
    return tensors_digest(path) if is_weights_file(str(name or path)) else file_sha256(path)


def rewrite_safetensors_metadata(path: str | os.PathLike[str], metadata: dict[str, str]) -> None:
    """Replace a safetensors file's ``__metadata__`` atomically, tensor bytes untouched."""
    path = Path(path)
    header, n = read_safetensors_header(path)
    header[_METADATA] = dict(metadata)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # keep the data section 8-byte aligned
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(path, "rb") as src, open(tmp, "wb") as dst:
            dst.write(struct.pack("<Q", len(encoded)))
            dst.write(encoded)
            src.seek(8 + n)
            while chunk := src.read(CHUNK):
                dst.write(chunk)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


_NONFINITE_BITS: dict[str, tuple[str, int]] = {
    "F64": ("<u8", 0x7FF0_0000_0000_0000),
    "F32": ("<u4", 0x7F80_0000),
    "F16": ("<u2", 0x7C00),
    "BF16": ("<u2", 0x7F80),
    "F8_E5M2": ("u1", 0x7C),
    "F8_E4M3": ("u1", 0x7F),  # e4m3fn has no infinity: S.1111.111 alone is NaN
}
"""Each floating safetensors dtype: its elements read as unsigned integers, and the bits that are
all set in NaN and the infinities alone (the whole exponent; e4m3fn's NaN also its mantissa)."""
_SHOWN = 8  # the tensors a problem names before it counts the rest


def nonfinite_count(data: bytes | npt.NDArray[np.uint8], dtype: str) -> int:
    """How many of the elements in ``data`` (little-endian, of the safetensors dtype ``dtype``)
    are NaN or infinite; 0 for an integer or boolean dtype. The one rule: ``verify`` reads
    weights files by it (``nonfinite_in_file``), the importer checkpoints
    (``nonfinite_problem``)."""
    if dtype not in _NONFINITE_BITS:
        return 0
    view, bits = _NONFINITE_BITS[dtype]
    size = np.dtype(view).itemsize
    values = np.frombuffer(data, dtype=view, count=len(data) // size)
    return int(np.count_nonzero((values & bits) == bits))


def _nonfinite_named(names: list[str]) -> str | None:
    if not names:
        return None
    more = f" and {len(names) - _SHOWN} more tensors" if len(names) > _SHOWN else ""
    return f"NaN or infinite values in {', '.join(names[:_SHOWN])}{more}"


def nonfinite_problem(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """Which of ``tensors`` hold NaN or an infinity, by ``nonfinite_count`` on the bytes a
    weights file would store (None: none does)."""
    names = []
    for key in sorted(tensors):
        if tensors[key].is_floating_point():
            dtype, data = _stored(tensors[key])
            if nonfinite_count(data, dtype):
                names.append(key)
    return _nonfinite_named(names)


def nonfinite_in_file(path: Path) -> str | None:
    """``nonfinite_problem`` of a safetensors file, read a chunk at a time."""
    header, n = read_safetensors_header(path)
    names = []
    with open(path, "rb") as f:
        for key, entry in header_tensors(header).items():  # a truncation: the digest names it
            if any(nonfinite_count(c, entry["dtype"]) for c in _entry_chunks(f, n, entry)):
                names.append(key)
    return _nonfinite_named(names)
