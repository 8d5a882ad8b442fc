"""Errors as HTTP responses, in one place.

Three families reach the app: :class:`ServiceError` (HTTP-level: auth, request limits,
inference; each subclass here states its status, and no other module declares one), the store's :class:`service.store.errors.StoreError` and the library's
:class:`vip_hub.errors.VipHubError`. :func:`error_response` maps each onto a status and, for
the hub's lookups, the ``X-Error-Code`` that huggingface_hub clients turn into their own
exceptions (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``). The body is JSON
``{"error": message}``, the message also in ``X-Error-Message`` (one line).
"""

from __future__ import annotations

from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from vip_hub.errors import MissingInputError, VipHubError

from .store import errors as store

__all__ = [
    "BadRequest",
    "ClientGone",
    "DeadlineExceeded",
    "EntryNotFound",
    "Forbidden",
    "NotFound",
    "PayloadTooLarge",
    "QueueFull",
    "RepoNotFound",
    "RevisionNotFound",
    "ServiceError",
    "ShuttingDown",
    "Unauthorized",
    "error_response",
    "install",
]


class ServiceError(Exception):
    """Base of the HTTP-level errors: a status, an optional hub error code, a message, extra headers."""

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


class NotFound(ServiceError):
    """A page or record that is not a repo, revision or file (e.g. a dataset no release names)."""

    status = 404


class RevisionNotFound(ServiceError):
    status = 404
    code = "RevisionNotFound"


class EntryNotFound(ServiceError):
    status = 404
    code = "EntryNotFound"


class PayloadTooLarge(ServiceError):
    status = 413


class QueueFull(ServiceError):
    """A model's inference queue holds as many images as it may (retry after ``Retry-After``)."""

    status = 429


class ClientGone(ServiceError):
    """The client disconnected before its inference finished (nginx's 499: nobody reads it)."""

    status = 499


class ShuttingDown(ServiceError):
    """The inference engine is stopping or not started."""

    status = 503


class DeadlineExceeded(ServiceError):
    """An inference request waited past its deadline."""

    status = 503


# store error -> (status, hub error code); the first class that matches wins (subclasses first)
_STORE: tuple[tuple[type[store.StoreError], int, str | None], ...] = (
    (store.NoSuchRepo, 404, "RepoNotFound"),
    (store.NoSuchRevision, 404, "RevisionNotFound"),
    (store.NoSuchEntry, 404, "EntryNotFound"),
    (store.Conflict, 409, None),
    (store.SignatureRefused, 403, None),
    (store.TooLarge, 413, None),
    (store.InvalidRequest, 400, None),
    (store.StoreError, 400, None),
)


def error_response(err: Exception) -> JSONResponse:
    """The response for an error of any of the three families (anything else is a bug: 500)."""
    headers: dict[str, str] = {}
    if isinstance(err, ServiceError):
        status, code, message, headers = err.status, err.code, err.message, dict(err.headers)
    elif isinstance(err, store.StoreError):
        status, code = next((s, c) for cls, s, c in _STORE if isinstance(err, cls))
        message = str(err)
        if isinstance(err, store.NoSuchEntry) and err.commit:
            headers["X-Repo-Commit"] = err.commit  # lets the client cache the absence
    elif isinstance(err, VipHubError):
        status, code, message = (404 if isinstance(err, MissingInputError) else 400), None, str(err)
    else:
        raise TypeError(f"not a handled error family: {type(err).__name__}")
    headers["X-Error-Message"] = _header_safe(message)
    if code:
        headers["X-Error-Code"] = code
    return JSONResponse({"error": message}, status_code=status, headers=headers)


async def _handle(_request: Request, err: Exception) -> JSONResponse:
    return error_response(err)


def install(app: FastAPI) -> None:
    """Route the three error families to :func:`error_response`."""
    for family in (ServiceError, store.StoreError, VipHubError):
        app.add_exception_handler(family, _handle)


def _header_safe(text: str) -> str:
    """The message as a header value: printable ASCII only (a control character, as a request path
    may carry, makes the server drop the response); the body keeps the message as it is."""
    return "".join(c if " " <= c <= "~" else "?" for c in " ".join(text.split()))[:1000]
