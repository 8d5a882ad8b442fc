"""Operations routes: ``/healthz`` (alive), ``/readyz`` (configured models loaded and warm),
``/metrics`` (Prometheus), and the middleware that counts and times every request."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .metrics import Metrics

__all__ = ["install"]


def install(app: FastAPI, metrics: Metrics) -> None:
    """Add the metrics middleware and the operations routes to ``app``."""
    @app.middleware("http")
    async def count_requests(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        start = time.perf_counter()
        status = 500
        try:
            response = await call_next(request)
            status = response.status_code
            return response
        finally:
            route = request.scope.get("route")
            label = getattr(route, "path", None) or "unmatched"
            metrics.requests.labels(request.method, label, str(status)).inc()
            metrics.latency.labels(request.method, label, str(status)).observe(time.perf_counter() - start)

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
