"""What a released repo may not carry, whatever its files are named.

- Content that runs code when loaded, or hides such content: pickles (any protocol), zip
  archives (a PyTorch checkpoint is a zip of pickles), tar and compressed streams, NumPy
  arrays (object arrays are pickles). Found by looking at the bytes, not the name.
- config.json keys that send timm elsewhere for the weights: a repo's verified
  ``model.safetensors`` is what ``timm.create_model("hf-hub:…", pretrained=True)`` loads.

``vip_hub.repo.verify`` applies both rules, so the hub (which verifies every commit) does too.
"""

from __future__ import annotations

import io
import os
import pickletools
import struct
import zlib
from collections.abc import Mapping
from typing import Any, BinaryIO

__all__ = ["WEIGHT_SOURCE_KEYS", "refused_content", "weight_sources"]

WEIGHT_SOURCE_KEYS = frozenset(
    {
        "source",
        "url",
        "file",
        "state_dict",
        "hf_hub_id",
        "hf_hub_filename",  # timm _resolve_pretrained_source
        "custom_load",  # timm load_pretrained: hands the file to the model's own loader
    }
)
"""pretrained_cfg keys timm (1.0: ``models/_builder.py``) reads to find where weights come from."""

_MAGIC: tuple[tuple[int, bytes, str], ...] = (
    (0, b"PK\x03\x04", "a zip archive (PyTorch checkpoints are zip archives of pickles)"),
    (0, b"PK\x05\x06", "a zip archive"),
    (0, b"PK\x07\x08", "a zip archive"),
    (0, b"\x1f\x8b", "gzip-compressed data"),
    (0, b"BZh", "bzip2-compressed data"),
    (0, b"\xfd7zXZ\x00", "xz-compressed data"),
    (0, b"\x28\xb5\x2f\xfd", "zstd-compressed data"),
    (0, b"\x04\x22\x4d\x18", "lz4-compressed data"),
    (0, b"7z\xbc\xaf\x27\x1c", "a 7-zip archive"),
    (0, b"\x93NUMPY", "a NumPy array file (object arrays are pickles)"),
    (257, b"ustar", "a tar archive"),
)
_HEAD = 4096
_MAX_OPCODES = 64  # this many valid pickle opcodes in a row is a pickle, not text
_MAX_ARGUMENT = 1 << 20  # an opcode argument longer than this is a padded pickle


class _TooLong(Exception):
    """A pickle opcode argument longer than the scan reads."""


class _Capped:
    """A file as pickletools reads it, with each read bounded."""

    def __init__(self, f: BinaryIO):
        self._f, self._size = f, os.fstat(f.fileno()).st_size

    def read(self, n: int = -1) -> bytes:
        if n < 0 or n > self._size - self._f.tell():
            raise ValueError("a length past the end of the file: not a pickle")
        if n > _MAX_ARGUMENT:
            raise _TooLong
        return self._f.read(n)

    def readline(self) -> bytes:
        line = self._f.readline(_MAX_ARGUMENT + 1)
        if len(line) > _MAX_ARGUMENT:
            raise _TooLong
        return line


def refused_content(path: str | os.PathLike[str]) -> str | None:
    """What the file is when its bytes are a pickle, an archive or compressed data, else None."""
    with open(path, "rb") as f:
        head = f.read(_HEAD)
        for offset, magic, what in _MAGIC:
            if head[offset : offset + len(magic)] == magic:
                return what
        if _is_zlib(head):
            return "zlib-compressed data"
        f.seek(0)
        return "a pickle" if _is_pickle(f) else None


def _is_zlib(head: bytes) -> bool:
    if len(head) < 2 or head[0] & 0x0F != 8 or (head[0] << 8 | head[1]) % 31:
        return False
    try:
        return bool(zlib.decompressobj().decompress(head))
    except zlib.error:
        return False


def _is_pickle(f: BinaryIO) -> bool:
    """Whether the stream parses as pickle opcodes up to STOP, or for long enough (nothing runs)."""
    count = 0
    try:
        for opcode, _arg, _pos in pickletools.genops(_Capped(f)):  # type: ignore[arg-type]
            count += 1
            if opcode.name == "PROTO" or count >= _MAX_OPCODES:
                return True
        return count >= 3  # the shortest call of a global: GLOBAL, EMPTY_TUPLE, REDUCE, STOP
    except _TooLong:  # a valid opcode whose argument is padding
        return True
    except (ValueError, struct.error, OverflowError, io.UnsupportedOperation):
        return False


def weight_sources(config: Mapping[str, Any]) -> list[str]:
    """config.json keys that would make timm load weights from elsewhere (top level, where
    timm's legacy layout reads them, and ``pretrained_cfg``), as ``block.key``."""
    found = [f"config.json:{k}" for k in sorted(WEIGHT_SOURCE_KEYS & set(config))]
    cfg = config.get("pretrained_cfg", {})
    if not isinstance(cfg, Mapping):
        return [*found, "config.json:pretrained_cfg (not an object)"]
    return found + [
        f"config.json:pretrained_cfg.{k}" for k in sorted(WEIGHT_SOURCE_KEYS & set(cfg))
    ]
