"""Errors as HTTP responses, in one place.

Three families reach the app: :class:`ServiceError` (HTTP-level: auth, request limits,
inference; each subclass here states its status, and no other module declares one), the store's
:class:`service.store.errors.StoreError` and the library's :class:`vip_hub.errors.VipHubError`;
Starlette's own ``HTTPException`` (no route, a method a route does not take, a body its parsers
refuse) gets the same shape.
:func:`error_response` maps each onto a status and, for the hub's lookups, the ``X-Error-Code`` that
huggingface_hub clients turn into their own exceptions (``RepoNotFound``, ``RevisionNotFound``,
``EntryNotFound``). The body is JSON ``{"error": message}`` with any fields the error carries
(the url of a repo that exists, validate-yaml's ``errors``), the message also in
``X-Error-Message`` (one line).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from vip_hub.errors import MissingInputError, VipHubError

from .store import errors as store

__all__ = [
    "BadRequest",
    "ClientGone",
    "Conflicting",
    "DeadlineExceeded",
    "EntryNotFound",
    "Forbidden",
    "NotFound",
    "PayloadTooLarge",
    "PreconditionFailed",
    "QueueFull",
    "RangeNotSatisfiable",
    "RepoNotFound",
    "RequestTimeout",
    "RevisionNotFound",
    "ServiceError",
    "ShuttingDown",
    "StorageCorrupt",
    "StorageUnavailable",
    "Unauthorized",
    "error_response",
    "header_safe",
    "install",
]


class ServiceError(Exception):
    """Base of the HTTP-level errors: a status, an optional hub error code, a message, extra
    headers and extra body fields (beside ``error``). A subclass states its status
    (``class X(ServiceError, status=404)``); with ``hub_code=True`` its name is the
    ``X-Error-Code`` huggingface_hub clients read."""

    status: ClassVar[int] = 500
    code: ClassVar[str | None] = None
    retry_after_s: ClassVar[int | None] = None
    """Seconds a client is told to wait before it tries again (``Retry-After``), if any."""

    def __init_subclass__(cls, *, status: int, hub_code: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.status, cls.code = status, cls.__name__ if hub_code else None

    def __init__(
        self,
        message: str,
        headers: Mapping[str, str] | None = None,
        body: Mapping[str, Any] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.headers = dict(headers or {})
        self.body = dict(body or {})


class BadRequest(ServiceError, status=400):
    """A request the service does not accept; the message names what was wrong."""


class Unauthorized(ServiceError, status=401):
    """No valid token where the route needs one."""


class Forbidden(ServiceError, status=403):
    """A token whose scope or owner does not allow the operation."""


class RepoNotFound(ServiceError, status=404, hub_code=True):
    """No repo of that id that the caller may read."""


class RevisionNotFound(ServiceError, status=404, hub_code=True):
    """No branch, tag or commit of that name in the repo."""


class EntryNotFound(ServiceError, status=404, hub_code=True):
    """No file at that path in the revision."""


class NotFound(ServiceError, status=404):
    """A page or record that is not a repo, revision or file (e.g. a dataset no release names)."""


class RequestTimeout(ServiceError, status=408):
    """A request body that did not arrive within its time (``inference.body_timeout_s``)."""


class Conflicting(ServiceError, status=409):
    """The state changed under the request: a branch moved (stale parent), a tag exists."""


class PreconditionFailed(ServiceError, status=412):
    """An ``If-Match`` that names none of the file's ETags: the file is not the one the client
    meant to read."""


class PayloadTooLarge(ServiceError, status=413):
    """A body, an upload or an image over its limit."""


class RangeNotSatisfiable(ServiceError, status=416):
    """A ``Range`` that starts at or past the file's end (``Content-Range: bytes */size``)."""


class QueueFull(ServiceError, status=429):
    """A model's inference queue holds as many images as it may, or the inference routes serve
    as many requests as they may at once (retry after ``Retry-After``)."""

    retry_after_s = 1


class ClientGone(ServiceError, status=499):
    """The client disconnected before its inference finished (nginx's 499: nobody reads it)."""


class StorageCorrupt(ServiceError, status=500):
    """A stored object read back with bytes other than those the hub stored: the server's fault
    (not the request's), and not one a retry mends: an operator runs ``vip-hub store check``."""


class ModelLoadFailed(ServiceError, status=500):
    """A model that verified failed to load for a reason no library error names (the server's
    log has its traceback); kept, and answered again, as a repo's failed load is."""


class ModelLoadShortOf(ServiceError, status=503):
    """A model's load ran out of the machine's memory, disk or file handles: the machine's
    state, not the commit's, so it is not kept (retry after ``Retry-After``)."""

    retry_after_s = 5


class ShuttingDown(ServiceError, status=503):
    """The inference engine is stopping or not started."""

    retry_after_s = 5

    def __init__(self, message: str = "the server is shutting down"):
        super().__init__(message)


class DeadlineExceeded(ServiceError, status=503):
    """An inference request waited past its deadline."""

    retry_after_s = 1


class StorageUnavailable(ServiceError, status=503):
    """The object store does not answer; nothing was stored (retry after ``Retry-After``)."""


# store error -> the service error it is answered as; the first class that matches wins
# (subclasses first)
_STORE: tuple[tuple[type[store.StoreError], type[ServiceError]], ...] = (
    (store.NoSuchRepo, RepoNotFound),
    (store.NoSuchRevision, RevisionNotFound),
    (store.NoSuchEntry, EntryNotFound),
    (store.Conflict, Conflicting),
    (store.SignatureRefused, Forbidden),
    (store.TooLarge, PayloadTooLarge),
    (store.TooMuchStaged, QueueFull),
    (store.TooMuchUncommitted, QueueFull),
    (store.StoreUnavailable, StorageUnavailable),
    (store.CorruptObject, StorageCorrupt),
    (store.StoreError, BadRequest),
)


def error_response(err: Exception) -> JSONResponse:
    """The response for an error of any of the three families or Starlette's ``HTTPException``
    (anything else is a bug: 500)."""
    headers: dict[str, str] = {}
    body: dict[str, Any] = {}
    if isinstance(err, ServiceError):
        status, code, message, headers = err.status, err.code, err.message, dict(err.headers)
        body = err.body
        if err.retry_after_s is not None:
            headers["Retry-After"] = str(err.retry_after_s)
    elif isinstance(err, store.StoreError):
        answer = next(service for cls, service in _STORE if isinstance(err, cls))
        status, code = answer.status, answer.code
        message = str(err)
        if isinstance(err, store.NoSuchEntry) and err.commit:
            headers["X-Repo-Commit"] = err.commit  # lets the client cache the absence
        retry = err.retry_after_s if isinstance(err, store.StoreUnavailable) else None
        if (retry := retry or answer.retry_after_s) is not None:
            headers["Retry-After"] = str(retry)
    elif isinstance(err, VipHubError):
        status, code, message = (404 if isinstance(err, MissingInputError) else 400), None, str(err)
    elif isinstance(err, HTTPException):
        status, code, message = err.status_code, None, str(err.detail)
        headers = dict(err.headers or {})
    else:
        raise TypeError(f"not a handled error family: {type(err).__name__}")
    headers["X-Error-Message"] = header_safe(message)
    if code:
        headers["X-Error-Code"] = code
    return JSONResponse({"error": message, **body}, status_code=status, headers=headers)


async def _handle(_request: Request, err: Exception) -> JSONResponse:
    return error_response(err)


async def _starlette(request: Request, err: Exception) -> JSONResponse:
    """Starlette's routing and parsing errors, said in full: the method and path a 405 or 404
    is about, and what a parser raised under a bare "error parsing the body"."""
    assert isinstance(err, HTTPException)
    where = f"{request.method} {request.url.path}"
    detail = {
        404: f"{where}: not found",
        405: f"{where}: the route takes {(err.headers or {}).get('Allow', 'other methods')}",
    }.get(err.status_code, str(err.detail))
    if err.__cause__ is not None:
        detail += f": {type(err.__cause__).__name__}: {err.__cause__}"
    return error_response(HTTPException(err.status_code, detail, err.headers))


ECHO_CHARS = 200  # the longest text a 422 echoes back whole (an image's base64 is megabytes)
ECHO_ITEMS = 20  # the most items of a list, or keys of an object, a 422 echoes back


class _EchoJSON(JSONResponse):
    """JSON of what a client sent, as a 422 echoes it: Python's parser reads NaN, infinities and
    lone UTF-16 surrogates, which the plain response cannot write (a 500); they are written as
    text and as ASCII escapes, and a text longer than ``ECHO_CHARS`` is cut, saying its length,
    as is a list or an object of more than ``ECHO_ITEMS`` items. Every error is kept."""

    def render(self, content: Any) -> bytes:
        errors = [_echoable(error) for error in content["detail"]]
        return json.dumps({"detail": errors}, allow_nan=False, separators=(",", ":")).encode()


def _echoable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, str) and len(value) > ECHO_CHARS:
        return f"{value[:ECHO_CHARS]}... ({len(value):,} characters)"
    if isinstance(value, dict):
        kept = {k: _echoable(v) for k, v in itertools.islice(value.items(), ECHO_ITEMS)}
        if len(value) > ECHO_ITEMS:
            kept["..."] = f"({len(value):,} keys)"
        return kept
    if isinstance(value, list):
        items = [_echoable(v) for v in value[:ECHO_ITEMS]]
        return items + [f"... ({len(value):,} items)"] if len(value) > ECHO_ITEMS else items
    return value


async def _invalid(_request: Request, err: Exception) -> JSONResponse:
    """FastAPI's 422 (``{"detail": [...]}``, each error's ``loc`` naming the field), writable
    whatever the body held."""
    assert isinstance(err, RequestValidationError)
    # a body FastAPI did not parse (not sent as JSON) is echoed as bytes, which may be no UTF-8
    readable = {bytes: lambda b: b.decode("utf-8", "replace")}
    return _EchoJSON(
        {"detail": jsonable_encoder(err.errors(), custom_encoder=readable)}, status_code=422
    )


async def _gone(request: Request, _err: Exception) -> JSONResponse:
    """A client that hung up before its body arrived: a 499 nobody reads, not a server fault."""
    return error_response(
        ClientGone(
            f"{request.method} {request.url.path}: the client hung up before its body arrived"
        )
    )


def install(app: FastAPI) -> None:
    """Route the three error families, Starlette's own and a client's hang-up to
    :func:`error_response`, and request validation errors to a 422 that any parsed body can be
    echoed in."""
    for family in (ServiceError, store.StoreError, VipHubError):
        app.add_exception_handler(family, _handle)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(HTTPException, _starlette)
    app.add_exception_handler(ClientDisconnect, _gone)


def header_safe(text: str) -> str:
    """The message as a header value: printable ASCII only (a control character, as a request path
    may carry, makes the server drop the response); the body keeps the message as it is."""
    return "".join(c if " " <= c <= "~" else "?" for c in " ".join(text.split()))[:1000]
