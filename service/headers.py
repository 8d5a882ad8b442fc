"""Headers every response carries, errors and redirects included."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["NoSniffMiddleware"]

NOSNIFF = (b"x-content-type-options", b"nosniff")
"""Browsers take a response as the type it declares, never as what its bytes look like (a
repo file served as ``application/octet-stream`` or ``text/plain`` is never run as HTML or
script)."""


class NoSniffMiddleware:
    """Add ``X-Content-Type-Options: nosniff`` to every HTTP response (pure ASGI: bodies
    stream through untouched)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), NOSNIFF]
            await send(message)

        await self.app(scope, receive, send_with_header)
