"""An ASGI middleware that bounds ``/v1/*`` request bodies before any parsing: total bytes
(413) and, for JSON, nesting depth (400), so oversized or pathological bodies never reach
the JSON parser or the multipart parser unbounded."""

from __future__ import annotations

import re
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import BadRequest, PayloadTooLarge, ServiceError, error_response

__all__ = ["BodyLimitMiddleware", "json_depth"]

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # runs of plain bytes in one step

def json_depth(body: bytes, stop_above: int | None = None) -> int:
    """Deepest nesting of arrays/objects in a JSON text (strings ignored); the scan stops as
    soon as the depth passes ``stop_above``."""
    if stop_above is not None and body.count(b"[") + body.count(b"{") <= stop_above:
        return stop_above  # too few brackets, in strings or not, to nest that deep
    text = _STRING.sub(b'""', body)
    if stop_above is not None and text.count(b"[") + text.count(b"{") <= stop_above:
        return stop_above
    depth = deepest = 0
    for ch in text:
        if ch in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > deepest:
                deepest = depth
                if stop_above is not None and deepest > stop_above:
                    break
        elif ch in (0x5D, 0x7D):
            depth -= 1
    return deepest

class BodyLimitMiddleware:
    """Buffer a ``/v1/`` request body up to ``max_bytes``; check JSON depth; replay it."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_depth: int, prefix: str = "/v1/"):
        self.app, self.max_bytes, self.max_depth, self.prefix = app, max_bytes, max_depth, prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix) or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read(scope, receive)
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

    async def _read(self, scope: Scope, receive: Receive) -> bytes:
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            raise PayloadTooLarge(f"request body of {int(declared)} bytes exceeds the limit of {self.max_bytes}")
        chunks, size = [], 0
        while True:
            message: Any = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise PayloadTooLarge(f"request body exceeds the limit of {self.max_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if b"json" in headers.get(b"content-type", b"") and json_depth(body, self.max_depth) > self.max_depth:
            raise BadRequest(f"JSON nested deeper than {self.max_depth} levels")
        return body

