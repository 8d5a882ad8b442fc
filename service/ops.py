"""Operations routes: ``/healthz`` (alive), ``/readyz`` (configured models loaded and warm:
it names only the models the caller may read), ``/metrics`` (Prometheus: private models are
labelled by commit, never by repo name), and the middleware that counts, times and logs
every request.

The access log is written by that middleware once the response has gone out, with its
duration, instead of by uvicorn as the response starts (which holds every response back by
the time it takes to format and write the line): ``log_config()`` is what ``vip-hub serve``
gives uvicorn, with uvicorn's own access log off. It writes each request's path and query with
the values of ``CREDENTIAL_PARAMETERS`` replaced by ``REDACTED``: an upload grant in a URL is a
bearer credential for an hour."""

from __future__ import annotations

import copy
import logging
import time
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import quote, unquote_plus

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.config import LOG_LEVELS, LOGGING_CONFIG
from uvicorn.protocols.utils import get_client_addr

from .auth import identity_or_anonymous
from .metrics import Metrics
from .store.errors import StoreError

if TYPE_CHECKING:
    from uvicorn._types import WWWScope  # starlette types a scope as a plain mapping

__all__ = [
    "ACCESS_LOGGER",
    "CREDENTIAL_PARAMETERS",
    "InFlightMiddleware",
    "install",
    "log_config",
    "logged_target",
]

ACCESS_LOGGER = "vip_hub.access"
_access = logging.getLogger(ACCESS_LOGGER)
CREDENTIAL_PARAMETERS = frozenset(
    {"grant", "x-amz-signature", "x-amz-credential", "x-amz-security-token"}
)
"""Query parameters (any case) whose values are credentials: the hub's upload grants, and a
presigned S3 URL's signature, access key and session token (should a client send one here)."""


def log_config(level: str = "info") -> dict[str, Any]:
    """uvicorn's logging configuration plus our access logger (at ``level``, as uvicorn's would
    be), in uvicorn's access format with the request's duration."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config["formatters"]["vip_hub_access"] = {
        "()": "uvicorn.logging.AccessFormatter",
        "fmt": (
            '%(levelprefix)s %(client_addr)s - "%(request_line)s" %(status_code)s '
            "%(duration_ms).1f ms"
        ),
    }
    config["handlers"]["vip_hub_access"] = {
        **config["handlers"]["access"],
        "formatter": "vip_hub_access",
    }
    config["loggers"][ACCESS_LOGGER] = {
        "handlers": ["vip_hub_access"],
        "level": LOG_LEVELS[level],
        "propagate": False,
    }
    return config


def logged_target(scope: Scope) -> str:
    """The request's path and query as the access log writes them: the value of every
    ``CREDENTIAL_PARAMETERS`` parameter (its name percent-decoded, as the routes read it) is
    ``REDACTED``."""
    path, query = quote(scope["path"]), scope["query_string"].decode("latin-1")
    if not query:
        return path
    parts = [
        f"{name}=REDACTED" if unquote_plus(name).lower() in CREDENTIAL_PARAMETERS else part
        for part in query.split("&")
        for name in [part.partition("=")[0]]
    ]
    return f"{path}?{'&'.join(parts)}"


class RequestMetricsMiddleware:
    """Count, time and log every HTTP request by method, route template and status (pure ASGI,
    so it neither buffers bodies nor hides client disconnects from the endpoints)."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            seconds = time.perf_counter() - start
            label = getattr(scope.get("route"), "path", None) or "unmatched"
            labels = (scope["method"], label, str(status))
            self.metrics.requests.labels(*labels).inc()
            self.metrics.latency.labels(*labels).observe(seconds)
            if _access.isEnabledFor(logging.INFO):
                _access.info(
                    '%s - "%s %s HTTP/%s" %d',
                    get_client_addr(cast("WWWScope", scope)),  # an HTTP scope (checked above)
                    scope["method"],
                    logged_target(scope),
                    scope["http_version"],
                    status,
                    extra={"duration_ms": seconds * 1e3},
                )


class InFlightMiddleware:
    """Count the HTTP requests received and not yet answered (``vip_hub_requests_in_flight``),
    from the moment their head is parsed: the outermost layer, so a body still arriving or
    held by another layer counts too."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send)
        finally:
            self.metrics.in_flight.dec()


def install(app: FastAPI, metrics: Metrics) -> None:
    """Add the operations routes to ``app`` (its middleware, ``RequestMetricsMiddleware``, is
    added outside the body limits, by ``create_app``)."""

    @app.get("/healthz", tags=["operations"], summary="The process is alive")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(
        "/readyz",
        tags=["operations"],
        summary="Configured models are loaded and warmed up",
        responses={503: {"description": "not ready yet"}},
    )
    def readyz(request: Request) -> JSONResponse:
        engine = request.app.state.engine
        if engine is None:
            return JSONResponse({"status": "ready", "inference": "disabled"})
        who, store = identity_or_anonymous(request), request.app.state.store

        def visible(repo_id: str) -> bool:
            try:
                repo = store.get_repo(repo_id)
            except StoreError:  # not published yet, or not a repo id: nothing private to hide
                return True
            return not repo.private or (who is not None and who.owns(repo.org))

        state = engine.readiness(visible)
        return JSONResponse(state, status_code=200 if state["status"] == "ready" else 503)

    @app.get("/metrics", tags=["operations"], summary="Prometheus metrics")
    def metrics_endpoint() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
