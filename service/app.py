"""``create_app(settings)``: the one FastAPI app. The hub half (store protocol and web pages)
and the inference half (``/v1/*``) can each be switched off; the operations routes
(``/healthz``, ``/readyz``, ``/metrics``) are always there.

``app.state`` carries ``settings``, ``metrics``, ``store`` (a :class:`service.store.HubStore`,
opened at creation), ``tokens`` (a :class:`service.auth.TokenRegistry`) and, with inference on,
``engine`` (the inference engine, started and drained by the lifespan).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

import vip_hub

from .auth import TokenRegistry
from .body_limits import BodyLimit, BodyLimitMiddleware
from .errors import install as install_errors
from .headers import NoSniffMiddleware
from .metrics import Metrics
from .settings import Settings
from .store import HubStore

__all__ = ["create_app"]


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app for ``settings`` (read from the environment when omitted)."""
    settings = settings or Settings()
    metrics = Metrics()
    engine = None
    if settings.inference.enabled:
        from .inference.engine import InferenceEngine

        engine = InferenceEngine(settings.inference, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if engine is not None:
            await engine.start(app.state.store)
        try:
            yield
        finally:
            try:
                if engine is not None:
                    await engine.stop()
            finally:
                app.state.store.close()

    app = FastAPI(
        title="vip-hub",
        version=vip_hub.__version__,
        summary="Released private vision encoders: a model hub and an inference service.",
        lifespan=lifespan,
        docs_url="/docs" if settings.api_docs else None,
        redoc_url="/redoc" if settings.api_docs else None,
    )
    app.state.settings = settings
    app.state.store = HubStore.from_settings(settings)
    app.state.tokens = TokenRegistry.from_settings(settings, app.state.store)
    app.state.engine = engine
    app.state.metrics = metrics
    install_errors(app)

    from .ops import InFlightMiddleware, RequestMetricsMiddleware
    from .ops import install as install_ops

    install_ops(app, metrics)
    limits: list[BodyLimit] = []
    if engine is not None:
        from .inference.api import router as inference_router
        from .inference.captions import router as captions_router

        app.include_router(inference_router)
        app.include_router(captions_router)
        limits.append(
            BodyLimit(
                re.compile("/v1/"),
                settings.inference.max_request_bytes,
                max_json_depth=settings.inference.max_json_depth,
                max_json_commas=settings.inference.max_json_commas,
                max_pending=settings.inference.max_pending_requests,
                max_pending_bytes=settings.inference.max_pending_bytes,
                read_timeout_s=settings.inference.body_timeout_s,
            )
        )
    if settings.hub.enabled:
        from .hub.routes import STREAMED_UPLOADS
        from .hub.routes import router as hub_router
        from .pages.routes import install as install_pages

        app.include_router(hub_router)
        install_pages(app)
        limits.append(BodyLimit(STREAMED_UPLOADS, None))
    limits.append(BodyLimit(re.compile(""), settings.max_body_bytes))  # every other route
    app.add_middleware(BodyLimitMiddleware, rules=limits)
    # outside the body limits: what they refuse (413, 400, 429) is counted and logged too
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    app.add_middleware(NoSniffMiddleware)
    app.add_middleware(InFlightMiddleware, metrics=metrics)  # outermost: counts every request
    return app
