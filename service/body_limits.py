"""An ASGI middleware that bounds every request body before any parsing: total bytes (413),
and, where a route family asks, JSON's encoding (UTF-8), nesting depth (400) and values (413: a
parsed value costs about 80 bytes of memory per byte-and-a-half of text), checked in linear work
off the event loop, and the requests served at once (429 before the body is read), so no body
reaches the JSON or multipart parser unbounded and the bodies held in memory are bounded. Routes
that stream their bodies to disk (commits, LFS and Xet uploads) enforce their own limits as
they stream; their rule passes them through."""

from __future__ import annotations

import asyncio
import codecs
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import (
    BadRequest,
    PayloadTooLarge,
    QueueFull,
    RequestTimeout,
    ServiceError,
    error_response,
)

__all__ = ["BodyLimit", "BodyLimitMiddleware", "JsonDepth", "json_problem"]

_DELTA = np.zeros(256, np.int8)
_DELTA[[0x5B, 0x7B]], _DELTA[[0x5D, 0x7D]] = 1, -1  # [ { open, ] } close
_COMMA = 0x2C


class JsonDepth:
    """The nesting depth of a JSON text in one pass over it, block by block, and its commas (a
    list of n values holds n - 1): quotes, and the backslash runs that escape them, tracked
    across blocks; brackets and commas inside strings ignored.
    ``blocks`` counts the steps taken, each a fixed number of vector operations on ``BLOCK``
    bytes, so the work grows linearly with the text (a regex over its strings grew
    quadratically)."""

    BLOCK = 1 << 18

    def __init__(self, stop_above: int | None = None):
        self.stop_above = stop_above
        self.depth = self.deepest = self.blocks = self.commas = 0
        self.in_string = 0  # 1 inside a string
        self.backslashes = 0  # the run of backslashes that ended the last block

    def feed(self, data: bytes) -> int:
        """Scan ``data`` after what was fed before; the deepest nesting so far (the scan stops
        once it passes ``stop_above``)."""
        view = memoryview(data)
        for start in range(0, len(view), self.BLOCK):
            if self.stop_above is not None and self.deepest > self.stop_above:
                break
            self._scan(np.frombuffer(view[start : start + self.BLOCK], np.uint8))
        return self.deepest

    def _scan(self, block: np.ndarray) -> None:
        self.blocks += 1
        quote = block == 0x22
        backslash = block == 0x5C
        if self.backslashes or backslash.any():  # a quote after an odd run of them is escaped
            at = np.arange(len(block), dtype=np.int32)
            last_other = np.where(backslash, np.int32(-1 - self.backslashes), at)
            np.maximum.accumulate(last_other, out=last_other)
            quote[0] &= self.backslashes % 2 == 0
            quote[1:] &= (at[1:] - last_other[:-1]) % 2 == 1
            self.backslashes = int(len(block) - 1 - last_other[-1])
        inside = np.cumsum(quote, dtype=np.int32)
        inside += self.in_string
        inside &= 1
        self.commas += int(np.count_nonzero((block == _COMMA) & (inside == 0)))
        delta = _DELTA[block]
        delta[inside == 1] = 0
        path = np.cumsum(delta, dtype=np.int32)
        path += self.depth
        self.deepest = max(self.deepest, int(path.max()))
        self.depth, self.in_string = int(path[-1]), int(inside[-1])


def json_problem(body: bytes, max_depth: int, max_commas: int) -> ServiceError | None:
    """400 for a JSON text not in UTF-8 or nested deeper than ``max_depth``, 413 for one holding
    more than ``max_commas`` commas outside its strings (values), else None; linear work."""
    if b"\0" in body:  # UTF-8 JSON has none; in UTF-16 or -32 a character's bytes can be a quote
        return BadRequest("JSON body is not UTF-8 (RFC 8259): it holds NUL bytes, as UTF-16 does")
    if (bad := _not_utf8(body)) is not None:
        return BadRequest(f"JSON body is not UTF-8 (RFC 8259): byte {bad[0]} is {bad[1]}")
    if (long := _long_integer(body)) is not None:
        return BadRequest(
            f"JSON body holds an integer of {long[1]:,} digits at byte {long[0]}, over the "
            f"{sys.get_int_max_str_digits():,} Python reads"
        )
    if body.count(b"[") + body.count(b"{") <= max_depth and body.count(b",") <= max_commas:
        return None  # too few brackets and commas, in strings or not, to pass either bound
    scan = JsonDepth(max_depth)
    scan.feed(body)
    if scan.deepest > max_depth:
        return BadRequest(f"JSON nested deeper than {max_depth} levels")
    if scan.commas > max_commas:
        return PayloadTooLarge(
            f"JSON body holds more than {max_commas + 1} values in its lists and objects"
        )
    return None


def _long_integer(body: bytes) -> tuple[int, int] | None:
    """Where the first integer outside JSON's strings that is longer than Python reads
    (``sys.get_int_max_str_digits``) starts in ``body``, and its digits; the parser refuses one
    without saying where. Linear: each run of digits is tried once, from its start."""
    if not (limit := sys.get_int_max_str_digits()) or not _has_digits(body, limit + 1):
        return None
    strings, fed = JsonDepth(), 0
    for run in re.finditer(rb"(?<![0-9])[0-9]{%d,}" % (limit + 1), body):
        start, end = run.span()
        if body[end : end + 1] in (b".", b"e", b"E") or body[start - 2 : start].endswith(
            (b".", b"e", b"E", b"+", b"e-", b"E-")
        ):
            continue  # a fraction or an exponent: read as a float, at any length
        strings.feed(body[fed:start])
        fed = start
        if not strings.in_string:
            return start - (body[start - 1 : start] == b"-"), end - start
    return None


_DIGIT_MASK = bytes(0x30 if 0x30 <= byte <= 0x39 else 0x20 for byte in range(256))


def _has_digits(body: bytes, count: int) -> bool:
    """Whether ``body`` holds a run of ``count`` digits, a block at a time: a byte search, ten
    times as fast as a regex that reads each digit."""
    run, step = b"0" * count, JsonDepth.BLOCK
    return any(
        body[start : start + step + count].translate(_DIGIT_MASK).find(run) != -1
        for start in range(0, len(body), step)
    )


def _not_utf8(body: bytes) -> tuple[int, str] | None:
    """Where ``body`` stops being UTF-8, and why; decoded a block at a time and dropped, so the
    check holds no copy of the body (a text as large as it, per body served at once)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    view = memoryview(body)
    for start in range(0, len(view), JsonDepth.BLOCK):
        pending = len(decoder.getstate()[0])  # a character's first bytes, from the last block
        try:
            decoder.decode(view[start : start + JsonDepth.BLOCK])
        except UnicodeDecodeError as e:
            return start - pending + e.start, e.reason
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as e:
        return len(body) - len(decoder.getstate()[0]) + e.start, e.reason
    return None


@dataclass(frozen=True)
class BodyLimit:
    """The body limit of the request paths ``pattern`` matches: ``max_bytes`` (None: the route
    streams the body under its own limit) and, when set, a JSON body's ``max_json_depth`` and
    ``max_json_commas`` (its values, less one), how many requests with a body
    (``max_pending``), holding how many bytes together
    (``max_pending_bytes``), are served at once: more are answered 429 before their body is
    read, and how long an admitted body may take to arrive (``read_timeout_s``, else 408)."""

    pattern: re.Pattern[str]
    max_bytes: int | None
    max_json_depth: int | None = None
    max_json_commas: int | None = None
    max_pending: int | None = None
    max_pending_bytes: int | None = None
    read_timeout_s: float | None = None


@dataclass
class _Pending:
    """The requests with a body a rule has admitted and not yet answered, and their bytes."""

    requests: int = 0
    bytes: int = 0


class BodyLimitMiddleware:
    """Admit a request under its rule's pending bounds, buffer its body up to the rule's limit,
    check its JSON depth where the rule asks (in a worker thread: the event loop keeps serving),
    and replay it to the app."""

    def __init__(self, app: ASGIApp, rules: Sequence[BodyLimit]):
        self.app, self.rules = app, list(rules)
        self._pending = {rule: _Pending() for rule in self.rules}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rule = next((r for r in self.rules if r.pattern.match(scope.get("path", ""))), None)
        if scope["type"] != "http" or rule is None or rule.max_bytes is None:
            await self.app(scope, receive, send)
            return
        if repeated := _repeated(scope.get("headers") or []):
            message = f"the {repeated} header is sent more than once"
            await error_response(BadRequest(message))(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        size = _body_size(headers, rule.max_bytes)
        pending = self._pending[rule]
        try:
            _admit(pending, rule, size, scope["path"])
        except ServiceError as err:
            await error_response(err)(scope, receive, send)
            return
        counted = 1 if size else 0
        pending.requests, pending.bytes = pending.requests + counted, pending.bytes + size
        try:
            try:
                body = await self._read(scope, receive, rule, headers)
            except ServiceError as err:
                await error_response(err)(scope, receive, send)
                return
            replayed = False

            async def replay() -> Message:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            await self.app(scope, replay, send)
        finally:
            pending.requests, pending.bytes = pending.requests - counted, pending.bytes - size

    @staticmethod
    async def _read(
        scope: Scope, receive: Receive, rule: BodyLimit, headers: dict[bytes, bytes]
    ) -> bytes:
        limit = rule.max_bytes or 0
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(
                f"request body of {int(declared)} bytes exceeds the limit of {limit} "
                f"for {scope['path']}"
            )
        chunks: list[bytes] = []
        try:
            async with asyncio.timeout(rule.read_timeout_s):
                await _receive_into(chunks, receive, limit, scope["path"])
        except TimeoutError:
            raise RequestTimeout(
                f"the request body did not arrive within {rule.read_timeout_s:g} s"
            ) from None
        body = b"".join(chunks)
        chunks.clear()  # from here the body is held once
        depth, commas = rule.max_json_depth, rule.max_json_commas
        is_json = b"json" in _lowered(headers, b"content-type")  # as FastAPI reads it
        if is_json and depth is not None and commas is not None:
            problem = await run_in_threadpool(json_problem, body, depth, commas)
            if problem is not None:
                raise problem
        return body


async def _receive_into(chunks: list[bytes], receive: Receive, limit: int, path: str) -> None:
    """Append the body's chunks to ``chunks`` until its end (or a disconnect); PayloadTooLarge
    once they pass ``limit`` bytes."""
    size = 0
    while True:
        message: Any = await receive()
        if message["type"] == "http.disconnect":
            return
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes for {path}")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return


_SINGLE = (b"content-type", b"content-length", b"transfer-encoding")
"""Headers a request sends once: of two, this middleware and the app could read different ones
(the JSON checks skipped for a body FastAPI then parses as JSON)."""


def _repeated(headers: Sequence[tuple[bytes, bytes]]) -> str | None:
    """The first of ``_SINGLE`` that ``headers`` (lower-case names, as ASGI gives them) repeat."""
    names = [name.lower() for name, _ in headers]
    return next((n.decode() for n in _SINGLE if names.count(n) > 1), None)


def _body_size(headers: dict[bytes, bytes], max_bytes: int) -> int:
    """The bytes a request's body will hold: its Content-Length, ``max_bytes`` for a chunked
    body (its length is not known in advance), 0 without a body."""
    declared = headers.get(b"content-length")
    if declared is not None and declared.isdigit():
        return min(int(declared), max_bytes)
    return max_bytes if b"chunked" in _lowered(headers, b"transfer-encoding") else 0


def _lowered(headers: dict[bytes, bytes], name: bytes) -> bytes:
    """A header's value in lower case (media types and transfer codings are case-insensitive:
    ``Chunked`` is chunked), empty when absent."""
    return headers.get(name, b"").lower()


def _admit(pending: _Pending, rule: BodyLimit, size: int, path: str) -> None:
    """QueueFull (429, Retry-After) if a body of ``size`` bytes would pass ``rule``'s bounds on
    the requests served at once; a request without a body always passes."""
    if not size:
        return
    if rule.max_pending is not None and pending.requests >= rule.max_pending:
        raise QueueFull(
            f"{pending.requests} requests like {path} are being served, the most at once: "
            f"retry after {QueueFull.retry_after_s} s"
        )
    if rule.max_pending_bytes is not None and pending.bytes + size > rule.max_pending_bytes:
        raise QueueFull(
            f"the requests being served hold {pending.bytes} bytes; this one's {size} more "
            f"would pass the limit of {rule.max_pending_bytes}: retry after "
            f"{QueueFull.retry_after_s} s"
        )
