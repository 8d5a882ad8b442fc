"""Commit bodies (NDJSON, as ``HfApi.create_commit`` sends them), streamed to disk and parsed
without holding a file's content in memory.

Each ``file`` line carries one file base64-encoded; a line can be hundreds of MB. The body
is first written to a temp file (under the size limit). Short lines are parsed with
``json.loads``; for a long line the base64 string (the longest string in it: base64 has no
quote characters) is decoded to its own temp file straight from disk, and the rest of the
line is parsed with the string emptied.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import BadRequest, PayloadTooLarge
from ..store import AddFile, BlobStore, DeleteFile, DeleteFolder

__all__ = ["CommitRequest", "parse_commit_body", "spool_body"]

SMALL_LINE = 8 * 1024 * 1024
_CHUNK = 1 << 20
_B64 = re.compile(rb"^[A-Za-z0-9+/=\s]*$")


@dataclass
class CommitRequest:
    """A parsed commit: its header and operations (AddFile sources are temp files)."""

    summary: str = ""
    description: str = ""
    parent_commit: str | None = None
    operations: list[AddFile | DeleteFile | DeleteFolder] = field(default_factory=list)

    def discard(self) -> None:
        """Remove the temp files of a commit that will not be made."""
        for op in self.operations:
            if isinstance(op, AddFile):
                op.source.unlink(missing_ok=True)


async def spool_body(stream: AsyncIterator[bytes], blobs: BlobStore, limit: int) -> Path:
    """Write a request body to a temp file, refusing it (413) past ``limit`` bytes."""
    path = blobs.new_temp(".body")
    size = 0
    try:
        with open(path, "wb") as f:
            async for chunk in stream:
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"commit body exceeds the upload limit of {limit} bytes")
                f.write(chunk)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


def parse_commit_body(body: Path, blobs: BlobStore) -> CommitRequest:
    """Parse a spooled NDJSON commit body; the body file is consumed."""
    commit = CommitRequest()
    saw_header = False
    try:
        with open(body, "rb") as f:
            for number, (start, end) in enumerate(_line_spans(f), start=1):
                item = _read_item(f, start, end, blobs, number)
                key, value = item.get("key"), item.get("value")
                if not isinstance(value, dict):
                    raise BadRequest(f"commit line {number}: 'value' must be an object")
                if key == "header":
                    saw_header = True
                    commit.summary = str(value.get("summary") or "")
                    commit.description = str(value.get("description") or "")
                    commit.parent_commit = value.get("parentCommit")
                elif key == "file":
                    commit.operations.append(_file_op(value, number))
                elif key == "deletedFile":
                    commit.operations.append(DeleteFile(_path(value, number)))
                elif key == "deletedFolder":
                    commit.operations.append(DeleteFolder(_path(value, number)))
                elif key == "lfsFile":
                    raise BadRequest(
                        "LFS uploads are not supported by this hub: it answers 'regular' upload mode "
                        "to preupload, so clients send content inline"
                    )
                else:
                    raise BadRequest(f"commit line {number}: unknown key {key!r}")
    except BaseException:
        commit.discard()
        raise
    finally:
        body.unlink(missing_ok=True)
    if not saw_header:
        commit.discard()
        raise BadRequest("commit body has no header line")
    return commit


def _line_spans(f: BinaryIO) -> Iterator[tuple[int, int]]:
    """(start, end) byte offsets of each non-empty line."""
    start = pos = 0
    while chunk := f.read(_CHUNK):
        i = 0
        while (j := chunk.find(b"\n", i)) != -1:
            if pos + j > start:
                yield start, pos + j
            start = pos + j + 1
            i = j + 1
        pos += len(chunk)
    if pos > start:
        yield start, pos


def _read_item(f: BinaryIO, start: int, end: int, blobs: BlobStore, number: int) -> dict[str, Any]:
    here = f.tell()
    try:
        if end - start <= SMALL_LINE:
            f.seek(start)
            item = _loads(f.read(end - start), number)
            value = item.get("value")
            if isinstance(value, dict) and isinstance(value.get("content"), str):
                source = blobs.new_temp()
                source.write_bytes(_b64decode(value["content"].encode(), number))
                value["content"] = source
            return item
        return _read_long_item(f, start, end, blobs, number)
    finally:
        f.seek(here)


def _read_long_item(f: BinaryIO, start: int, end: int, blobs: BlobStore, number: int) -> dict[str, Any]:
    quotes = []
    f.seek(start)
    pos = start
    while pos < end:
        chunk = f.read(min(_CHUNK, end - pos))
        quotes.extend(pos + m.start() for m in re.finditer(rb'"', chunk))
        pos += len(chunk)
    if len(quotes) < 2:
        raise BadRequest(f"commit line {number}: not valid JSON")
    gap_start, gap_end = max(zip(quotes, quotes[1:]), key=lambda q: q[1] - q[0])
    f.seek(start)
    head = f.read(gap_start + 1 - start)
    f.seek(gap_end)
    tail = f.read(end - gap_end)
    item = _loads(head + tail, number)
    value = item.get("value")
    if not (isinstance(value, dict) and value.get("content") == ""):
        raise BadRequest(f"commit line {number}: a long line must be a file with base64 content")
    source = blobs.new_temp()
    try:
        with open(source, "wb") as out:
            f.seek(gap_start + 1)
            remaining, pending, buffer = gap_end - gap_start - 1, b"", b""
            while remaining:
                raw = f.read(min(_CHUNK, remaining))
                remaining -= len(raw)
                raw = pending + raw
                pending = b""
                if raw.endswith(b"\\") and remaining:  # keep a split "\/" escape together
                    raw, pending = raw[:-1], b"\\"
                buffer += raw.replace(b"\\/", b"/")
                cut = len(buffer) if not remaining else len(buffer) - len(buffer) % 4
                out.write(_b64decode(buffer[:cut], number))
                buffer = buffer[cut:]
    except BaseException:
        source.unlink(missing_ok=True)
        raise
    value["content"] = source
    return item


def _loads(data: bytes, number: int) -> dict[str, Any]:
    try:
        item = json.loads(data)
    except ValueError as e:
        raise BadRequest(f"commit line {number}: not valid JSON ({e})") from None
    if not isinstance(item, dict):
        raise BadRequest(f"commit line {number}: must be a JSON object")
    return item


def _b64decode(data: bytes, number: int) -> bytes:
    if not _B64.match(data):
        raise BadRequest(f"commit line {number}: content is not base64")
    try:
        return base64.b64decode(data, validate=False)
    except (binascii.Error, ValueError) as e:
        raise BadRequest(f"commit line {number}: content is not base64 ({e})") from None


def _path(value: dict[str, Any], number: int) -> str:
    path = value.get("path")
    if not isinstance(path, str):
        raise BadRequest(f"commit line {number}: 'path' must be a string")
    return path


def _file_op(value: dict[str, Any], number: int) -> AddFile:
    path = _path(value, number)
    source = value.get("content")
    if value.get("encoding", "base64") != "base64" or not isinstance(source, Path):
        if isinstance(source, Path):
            os.unlink(source)
        raise BadRequest(f"commit line {number}: file {path!r} must carry base64 'content'")
    return AddFile(path, source)
