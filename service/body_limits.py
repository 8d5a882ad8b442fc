"""An ASGI middleware that bounds every request body before any parsing: total bytes (413)
and, where a route family asks, JSON nesting depth (400), so no body reaches the JSON or
multipart parser unbounded. Routes that stream their bodies to disk (commits, LFS and Xet
uploads) enforce their own limits as they stream; their rule passes them through."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import BadRequest, PayloadTooLarge, ServiceError, error_response

__all__ = ["BodyLimit", "BodyLimitMiddleware", "json_depth"]

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


@dataclass(frozen=True)
class BodyLimit:
    """The body limit of the request paths ``pattern`` matches: ``max_bytes`` (None: the route
    streams the body under its own limit) and, when set, a JSON body's ``max_json_depth``."""

    pattern: re.Pattern[str]
    max_bytes: int | None
    max_json_depth: int | None = None


class BodyLimitMiddleware:
    """Buffer a request body up to the limit of the first rule matching its path, check its
    JSON depth where the rule asks, and replay it to the app."""

    def __init__(self, app: ASGIApp, rules: Sequence[BodyLimit]):
        self.app, self.rules = app, list(rules)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rule = next((r for r in self.rules if r.pattern.match(scope.get("path", ""))), None)
        if scope["type"] != "http" or rule is None or rule.max_bytes is None:
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read(scope, receive, rule)
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

    @staticmethod
    async def _read(scope: Scope, receive: Receive, rule: BodyLimit) -> bytes:
        limit = rule.max_bytes or 0
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(
                f"request body of {int(declared)} bytes exceeds the limit of {limit} "
                f"for {scope['path']}"
            )
        chunks, size = [], 0
        while True:
            message: Any = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(
                    f"request body exceeds the limit of {limit} bytes for {scope['path']}"
                )
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        depth = rule.max_json_depth
        if (
            depth is not None
            and b"json" in headers.get(b"content-type", b"")
            and json_depth(body, depth) > depth
        ):
            raise BadRequest(f"JSON nested deeper than {depth} levels")
        return body
