"""Typed errors of the service, rendered the way huggingface_hub clients read them.

Each error becomes JSON ``{"error": message}`` with the message also in ``X-Error-Message``
(one line) and, for the hub's lookups, ``X-Error-Code`` (``RepoNotFound``,
``RevisionNotFound``, ``EntryNotFound``), which the clients map onto their own exceptions.
"""

from __future__ import annotations

from collections.abc import Mapping

from fastapi import Request
from fastapi.responses import JSONResponse

__all__ = [
    "BadRequest",
    "Conflict",
    "EntryNotFound",
    "Forbidden",
    "PayloadTooLarge",
    "RepoNotFound",
    "RevisionNotFound",
    "ServiceError",
    "Unauthorized",
    "error_response",
]


class ServiceError(Exception):
    """Base: an HTTP status, an optional hub error code, a message, extra headers."""

    status = 400
    code: str | None = None

    def __init__(self, message: str, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.headers = dict(headers or {})


class BadRequest(ServiceError):
    status = 400


class Unauthorized(ServiceError):
    status = 401


class Forbidden(ServiceError):
    status = 403


class RepoNotFound(ServiceError):
    status = 404
    code = "RepoNotFound"


class RevisionNotFound(ServiceError):
    status = 404
    code = "RevisionNotFound"


class EntryNotFound(ServiceError):
    status = 404
    code = "EntryNotFound"


class Conflict(ServiceError):
    status = 409


class PayloadTooLarge(ServiceError):
    status = 413


def error_response(err: ServiceError) -> JSONResponse:
    """The JSON response for ``err``."""
    headers = {"X-Error-Message": _header_safe(err.message), **err.headers}
    if err.code:
        headers["X-Error-Code"] = err.code
    return JSONResponse({"error": err.message}, status_code=err.status, headers=headers)


async def handle_service_error(_request: Request, err: Exception) -> JSONResponse:
    assert isinstance(err, ServiceError)
    return error_response(err)


def _header_safe(text: str) -> str:
    line = " ".join(text.split())
    return line.encode("latin-1", "replace").decode("latin-1")[:1000]
