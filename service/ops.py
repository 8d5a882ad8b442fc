"""Operations routes: ``/healthz`` (alive), ``/readyz`` (configured models loaded and warm),
``/metrics`` (Prometheus), and the middleware that counts and times every request."""

from __future__ import annotations

import time

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .metrics import Metrics

__all__ = ["install"]


class RequestMetricsMiddleware:
    """Count and time every HTTP request by method, route template and status (pure ASGI, so
    it neither buffers bodies nor hides client disconnects from the endpoints)."""

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
            label = getattr(scope.get("route"), "path", None) or "unmatched"
            labels = (scope["method"], label, str(status))
            self.metrics.requests.labels(*labels).inc()
            self.metrics.latency.labels(*labels).observe(time.perf_counter() - start)


def install(app: FastAPI, metrics: Metrics) -> None:
    """Add the metrics middleware and the operations routes to ``app``."""
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)

    @app.get("/healthz", tags=["operations"], summary="The process is alive")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["operations"], summary="Configured models are loaded and warmed up",
             responses={503: {"description": "not ready yet"}})
    def readyz(request: Request) -> JSONResponse:
        engine = request.app.state.engine
        if engine is None:
            return JSONResponse({"status": "ready", "inference": "disabled"})
        state = engine.readiness()
        return JSONResponse(state, status_code=200 if state["status"] == "ready" else 503)

    @app.get("/metrics", tags=["operations"], summary="Prometheus metrics")
    def metrics_endpoint() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
