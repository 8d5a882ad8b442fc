"""Commit bodies (NDJSON, as ``HfApi.create_commit`` sends them), parsed exactly as they
stream in, with bounded memory.

Each line is one JSON object: a ``header``, then ``file`` (content inline, base64),
``lfsFile`` (an object uploaded ahead, by SHA-256), ``deletedFile`` and ``deletedFolder``
lines. A ``file`` line can be hundreds of MB. :class:`CommitParser` is a small push parser
that tracks JSON's own structure (strings and their escapes, objects, arrays, keys), so it
knows exactly where every string starts and ends: the string at ``value.content`` is decoded
from base64 into a temp file as it arrives, everything else of the line (bounded in size)
is kept and read with ``json.loads``. A malformed body is refused with a 400 naming the line.
"""

from __future__ import annotations

import binascii
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from vip_hub.paths import open_private

from ..errors import BadRequest, PayloadTooLarge
from ..settings import HubSettings
from ..store import AddFile, AddObject, BlobStore, DeleteFile, DeleteFolder
from ..store.blobs import DigestWriter
from ..store.faults import crash_point

__all__ = ["CommitParser", "CommitRequest", "receive_blob", "receive_body"]

MAX_SKELETON = 1 << 20  # bytes of a line outside its file content
_STRUCTURE = re.compile(rb'["{}\[\]:,\n]')
_IN_STRING = re.compile(rb'["\\\n]')
_BASE64 = re.compile(rb"[A-Za-z0-9+/=]*")
_KEY_CAP = 64


@dataclass
class CommitRequest:
    """A parsed commit: its header and operations (AddFile sources are temp files)."""

    summary: str = ""
    description: str = ""
    parent_commit: str | None = None
    operations: list[AddFile | AddObject | DeleteFile | DeleteFolder] = field(default_factory=list)

    def discard(self) -> None:
        """Remove the temp files of a commit that will not be made."""
        for op in self.operations:
            if isinstance(op, AddFile):
                op.source.unlink(missing_ok=True)


class _Base64File:
    """Base64 text written in pieces, decoded into a file (strict alphabet and padding)."""

    def __init__(self, path: Path):
        self.path = path
        self._out: BinaryIO = open_private(path)
        self._pending = b""
        self._padded = False

    def write(self, text: bytes) -> None:
        if not _BASE64.fullmatch(text):
            raise ValueError("content is not base64")
        text = self._pending + text
        cut = len(text) - len(text) % 4
        self._pending = text[cut:]
        if not cut:
            return
        if self._padded:
            raise ValueError("content has base64 data after its padding")
        try:
            self._out.write(binascii.a2b_base64(text[:cut], strict_mode=True))
        except binascii.Error as e:
            raise ValueError(f"content is not base64 ({e})") from None
        crash_point("upload-partial")
        self._padded = text[cut - 1 : cut] == b"="

    def abort(self) -> None:
        self._out.close()

    def close(self) -> None:
        self._out.close()
        if self._pending:
            raise ValueError("content is not base64 (its length is not a multiple of 4)")


@dataclass
class _Container:
    kind: int  # ord("{") or ord("[")
    expect_key: bool = False
    key: bytes | None = None


class CommitParser:
    """Push parser of a commit body within ``limits`` (``max_upload_bytes`` bytes,
    ``max_commit_files`` operations): ``feed`` the bytes as they arrive, then ``finish``. On any
    error the caller calls ``discard`` (temp files are removed)."""

    def __init__(self, blobs: BlobStore, limits: HubSettings):
        self.blobs, self.limits, self.limit = blobs, limits, limits.max_upload_bytes
        self.commit = CommitRequest()
        self.received = 0
        self._line = 1
        self._skeleton = bytearray()
        self._stack: list[_Container] = []
        self._in_string = False
        self._string_is_key = False
        self._key = bytearray()
        self._escape: bytearray | None = None  # an escape sequence being read
        self._sink: _Base64File | None = None  # the current line's streamed content
        self._content: Path | None = None
        self._header_seen = False

    # ---------------------------------------------------------------- feeding
    def feed(self, data: bytes | bytearray) -> None:
        """Consume the next piece of the body."""
        data = bytes(data)  # the scanner slices it many times
        self.received += len(data)
        if self.received > self.limit:
            raise PayloadTooLarge(f"commit body exceeds the upload limit of {self.limit} bytes")
        try:
            i, n = 0, len(data)
            while i < n:
                i = self._string(data, i) if self._in_string else self._structure(data, i)
        except ValueError as e:
            raise BadRequest(f"commit line {self._line}: {e}") from None

    def finish(self) -> CommitRequest:
        """The parsed commit, once the whole body was fed."""
        if self._in_string or self._stack:
            raise BadRequest(f"commit line {self._line}: the body ends inside the line (truncated)")
        if self._skeleton.strip():
            try:
                self._end_line()
            except ValueError as e:
                raise BadRequest(f"commit line {self._line}: {e}") from None
        if not self._header_seen:
            raise BadRequest("commit body has no header line")
        return self.commit

    def discard(self) -> None:
        """Remove every temp file made so far."""
        self.commit.discard()
        if self._sink is not None:
            self._sink.abort()
        if self._content is not None:
            self._content.unlink(missing_ok=True)

    # ---------------------------------------------------------------- scanning
    def _structure(self, data: bytes, i: int) -> int:
        j, c = _run_until(_STRUCTURE, data, i, self._keep)
        if c is None:
            return j
        top = self._stack[-1] if self._stack else None
        if c == 0x0A:  # newline: the end of a line
            if self._stack:
                raise ValueError("the line ends inside a JSON object or array")
            if self._skeleton.strip():
                self._end_line()
            self._line += 1
            return j + 1
        if c == 0x22:  # a string starts
            self._in_string = True
            self._string_is_key = bool(top and top.expect_key)
            self._key.clear()
            if self._streams_here(top):
                self._content = self.blobs.new_temp()
                self._sink = _Base64File(self._content)
                self._keep(b'""')
            else:
                self._keep(b'"')
            return j + 1
        if c in (0x7B, 0x5B):  # { [
            self._stack.append(_Container(c, expect_key=c == 0x7B))
        elif c in (0x7D, 0x5D):  # } ]
            if not self._stack or self._stack[-1].kind != c - 2:
                raise ValueError(f"unexpected {chr(c)!r}")
            self._stack.pop()
        elif c == 0x3A and top and top.kind == 0x7B:  # :
            top.expect_key = False
        elif c == 0x2C and top and top.kind == 0x7B:  # ,
            top.expect_key, top.key = True, None
        self._keep(data[j : j + 1])
        return j + 1

    def _streams_here(self, top: _Container | None) -> bool:
        """Whether the string starting now is ``value.content``, the only one streamed."""
        here = (
            top is not None
            and not top.expect_key
            and len(self._stack) == 2
            and top.key == b"content"
            and self._stack[0].key == b"value"
        )
        if here and self._content is not None:
            raise ValueError("'content' appears twice")
        return here

    def _string(self, data: bytes, i: int) -> int:
        if self._escape is not None:
            return self._read_escape(data, i)
        j, c = _run_until(_IN_STRING, data, i, self._text)
        if c is None:
            return j
        if c == 0x0A:
            raise ValueError("a line ends inside a string (unterminated string)")
        if c == 0x5C:  # backslash
            self._escape = bytearray(b"\\")
            return self._read_escape(data, j + 1)
        self._in_string = False  # the closing quote
        if self._sink is not None:
            self._sink.close()
            self._sink = None
        else:
            self._keep(b'"')
        if self._string_is_key and self._stack:
            self._stack[-1].key = bytes(self._key) if len(self._key) <= _KEY_CAP else None
        return j + 1

    def _read_escape(self, data: bytes, i: int) -> int:
        esc = self._escape
        assert esc is not None
        while i < len(data) and len(esc) < (6 if esc[1:2] == b"u" else 2):
            esc.append(data[i])
            i += 1
        if len(esc) == (6 if esc[1:2] == b"u" else 2):
            self._escape = None
            if self._sink is None:
                self._text(bytes(esc))
            else:
                try:
                    char = json.loads(b'"' + esc + b'"').encode()
                except ValueError:
                    raise ValueError(f"invalid escape {bytes(esc)!r} in a string") from None
                self._sink.write(char)
        return i

    def _text(self, piece: bytes) -> None:
        """Characters inside a string: to the content file, or kept (and noted if a key)."""
        if self._sink is not None:
            self._sink.write(piece)
            return
        self._keep(piece)
        if self._string_is_key and len(self._key) <= _KEY_CAP:
            self._key += piece[: _KEY_CAP + 1]

    def _keep(self, piece: bytes) -> None:
        self._skeleton += piece
        if len(self._skeleton) > MAX_SKELETON:
            raise ValueError(f"longer than {MAX_SKELETON} bytes outside a file's base64 content")

    # ---------------------------------------------------------------- lines
    def _end_line(self) -> None:
        try:
            item = json.loads(self._skeleton)
        except (ValueError, RecursionError) as e:  # RecursionError: nested too deeply
            raise ValueError(f"not valid JSON ({e})") from None
        finally:
            self._skeleton.clear()
        content, self._content = self._content, None
        try:
            self._operation(item, content)
        except BaseException:
            if content is not None:
                content.unlink(missing_ok=True)
            raise

    def _operation(self, item: Any, content: Path | None) -> None:
        if not isinstance(item, dict) or not isinstance(item.get("value"), dict):
            raise ValueError("must be a JSON object with an object 'value'")
        key, value = item.get("key"), item["value"]
        if self._line == 1 and key != "header":
            raise ValueError(f"the first line must be the header, not {key!r}")
        if content is not None and key != "file":
            raise ValueError(f"a {key!r} line carries no 'content'")
        if key == "header":
            if self._header_seen:
                raise ValueError("a second header")
            self._header_seen = True
            self.commit.summary = _header_text(value, "summary")
            self.commit.description = _header_text(value, "description")
            parent = value.get("parentCommit")
            if not isinstance(parent, str | None):
                raise ValueError(f"'parentCommit' must be a commit id, not {parent!r}")
            self.commit.parent_commit = _header_text(value, "parentCommit") or None
        elif key == "file":
            self.commit.operations.append(AddFile(_path(value), self._file_content(value, content)))
        elif key == "lfsFile":
            oid, algo = value.get("oid"), value.get("algo", "sha256")
            if algo != "sha256" or not isinstance(oid, str):
                raise ValueError("an lfsFile line needs 'oid', a SHA-256 ('algo': 'sha256')")
            size = value.get("size")
            if size is not None and (type(size) is not int or size < 0):
                raise ValueError(f"an lfsFile line's 'size' must be a byte count, not {size!r}")
            self.commit.operations.append(AddObject(_path(value), oid, size))
        elif key == "deletedFile":
            self.commit.operations.append(DeleteFile(_path(value)))
        elif key == "deletedFolder":
            self.commit.operations.append(DeleteFolder(_path(value)))
        else:
            raise ValueError(f"unknown key {key!r}")
        what = f"the commit body (at line {self._line})"
        if problem := self.limits.commit_files_problem(len(self.commit.operations), what):
            raise PayloadTooLarge(problem)

    def _file_content(self, value: dict[str, Any], content: Path | None) -> Path:
        if value.get("encoding", "base64") != "base64":
            raise ValueError(f"file {value.get('path')!r}: only base64 'encoding' is accepted")
        if content is not None:
            return content
        text = value.get("content")  # a content string not streamed (a key written with escapes)
        if not isinstance(text, str):
            raise ValueError(f"file {value.get('path')!r} must carry base64 'content'")
        path = self.blobs.new_temp()
        sink = _Base64File(path)
        try:
            sink.write(text.encode())
            sink.close()
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return path


def _run_until(
    pattern: re.Pattern[bytes], data: bytes, i: int, take: Callable[[bytes], None]
) -> tuple[int, int | None]:
    """Hand the bytes from ``i`` up to the next match of ``pattern`` to ``take``; return where
    that match starts and its byte (``None``: no match, the chunk is used up)."""
    m = pattern.search(data, i)
    j = m.start() if m else len(data)
    take(data[i:j])
    return j, (data[j] if m else None)


def _header_text(value: dict[str, Any], key: str) -> str:
    """The header's ``key`` as text ('' when absent); one with a lone surrogate, which has no
    UTF-8 form (the index cannot keep it), is refused."""
    text = str(value.get(key) or "")
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError(f"the header's {key!r} is not UTF-8 text (a lone surrogate)") from None
    return text


def _path(value: dict[str, Any]) -> str:
    path = value.get("path")
    if not isinstance(path, str):
        raise ValueError("'path' must be a string")
    return path


BATCH = 4 << 20  # body bytes handed to a worker thread at once (bounded memory, few hops)


async def receive_body(request: Request, consume: Callable[[bytearray], None], limit: int) -> int:
    """Stream a request body to ``consume(bytes)`` in a worker thread, ``BATCH`` bytes at a
    time; 413 past ``limit`` bytes. Returns the body's size."""
    size, buffer = 0, bytearray()
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the upload limit of {limit} bytes")
        buffer += chunk
        if len(buffer) >= BATCH:
            full, buffer = buffer, bytearray()  # handed over as is: no copy
            await run_in_threadpool(consume, full)
    if buffer:
        await run_in_threadpool(consume, buffer)
    return size


async def receive_blob(request: Request, blobs: BlobStore, limit: int) -> tuple[DigestWriter, str]:
    """The request body (413 past ``limit`` bytes) in a new temp file of ``blobs``: its closed
    writer (path, size) and SHA-256. A body that fails leaves no file behind."""
    writer = blobs.writer()
    try:
        await receive_body(request, writer.write, limit)
        sha256 = await run_in_threadpool(writer.close)  # its fsync: off the loop
    except BaseException:
        writer.discard()
        raise
    return writer, sha256
