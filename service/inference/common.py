"""What the inference routers share (``api.py``, ``captions.py``): their router, the request
fields for a model and its images, the privacy and usage blocks of a response, and the call
(``Call``: the caller, the model lookup, the input checks, the run and the response headers)."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel, Field

from vip_hub.privacy.ledger import PrivacySummary, privacy_headline

from ..auth import Identity, check_read, identity, identity_or_anonymous, require_scope
from ..errors import BadRequest, PayloadTooLarge, header_safe
from ..hub.common import store_of
from ..settings import InferenceSettings
from ..store.naming import REPO_PART_PATTERN, REVISION_PATTERN
from .engine import InferenceEngine, Result, parse_model_ref
from .images import image_bytes_from_text
from .models import LoadedModel, Task

__all__ = [
    "ERRORS",
    "MAX_MODEL_REF_LENGTH",
    "MODEL_PATTERN",
    "Call",
    "Image64",
    "Images",
    "TopK",
    "InferenceCall",
    "ModelRef",
    "Privacy",
    "Usage",
    "caller",
    "disconnected",
    "new_router",
]

MODEL_PATTERN = rf"^{REPO_PART_PATTERN}/{REPO_PART_PATTERN}(@{REVISION_PATTERN})?$"
MAX_MODEL_REF_LENGTH = 300
ModelRef = Annotated[
    str, Field(pattern=MODEL_PATTERN, max_length=MAX_MODEL_REF_LENGTH, examples=["vip/vip-nano"])
]
Image64 = Annotated[str, Field(min_length=1, description="base64 image bytes, or a data: URI")]
Images = Annotated[
    Image64 | list[Image64], Field(description="one image or a list (base64 or data: URIs)")
]
"""A request's ``input``: what every image route takes."""
TopK = Annotated[int, Field(ge=1, le=1000, description="the most labels answered per image")]
"""A request's ``top_k``."""


class Privacy(BaseModel):
    """What a component's weights promise (``PrivacyLedger.summary``): a head's summary
    includes its encoder's stages."""

    epsilon: float | None = Field(
        description="the largest epsilon; 0 without private data; null "
        "when some private data was used without DP (no "
        "guarantee)"
    )
    delta: float
    datasets: list[str] = Field(description="private datasets with a DP guarantee")
    accountant: str | None
    private_data: bool
    unprotected_datasets: list[str] = Field(description="private datasets used WITHOUT a guarantee")
    caveat: str | None = Field(
        description="what the epsilon assumes but the training did not meet "
        "(an imported release that shuffled instead of "
        "Poisson-sampling), else null"
    )
    epsilon_without_amplification: float | None = Field(
        description="with a caveat: the epsilon that holds without amplification by sampling (PLD)"
    )
    headline: str = Field(
        description="the guarantee in one line, as the card and the pages state it"
    )

    @classmethod
    def of(cls, summary: PrivacySummary) -> Privacy:
        return cls(**summary.to_dict(), headline=privacy_headline(summary))


class Usage(BaseModel):
    """How many images a request computed."""

    images: int


ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "bad input (the message names the image index)"},
    404: {"description": "unknown model, revision or head"},
    413: {"description": "an image or the request is too large"},
    429: {"description": "the model's queue is full; retry after Retry-After seconds"},
    503: {"description": "deadline passed or shutting down"},
}


def caller(request: Request) -> Identity | None:
    """The caller; with ``auth.protect_inference`` a read token is required, else an unknown
    token counts as anonymous (OpenAI clients send ``api_key="EMPTY"``). (Not ``async``: the
    token lookup may query the index, PostgreSQL's over the network, which FastAPI then does in
    its thread pool, off the event loop.)"""
    if request.app.state.settings.auth.protect_inference:
        return require_scope(identity(request), "read", "inference")
    return identity_or_anonymous(request)


async def disconnected(request: Request) -> None:
    """Return once the client has gone away (the body is read: the server's ``receive`` now
    waits for the disconnect, or for the response to complete)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class InferenceCall:
    """One inference request as its route works with it: the request, the response (whose
    headers it sets) and the caller, with the steps every route takes."""

    def __init__(self, request: Request, response: Response, who: Identity | None):
        self.request, self.response, self.who = request, response, who

    @property
    def engine(self) -> InferenceEngine:
        """The app's inference engine (``app.state.engine``)."""
        return self.request.app.state.engine

    @property
    def settings(self) -> InferenceSettings:
        """The server's ``inference`` settings."""
        return self.request.app.state.settings.inference

    async def model(self, ref: str) -> LoadedModel:
        """The model ``ref`` (``org/name[@revision]``) names, loaded, if the caller may read it."""
        store = store_of(self.request)
        repo_id, revision = parse_model_ref(ref)

        def readable_commit() -> str:  # index queries: off the event loop
            check_read(store.get_repo(repo_id).private, repo_id, self.who)
            return store.resolve(repo_id, revision)

        return await self.engine.model(repo_id, await asyncio.to_thread(readable_commit))

    async def run(self, model: LoadedModel, images: list[bytes], task: Task) -> Result:
        """Compute ``task`` on ``images`` through the model's batcher; given up if the client
        leaves."""
        return await self.engine.run(model, images, task, partial(disconnected, self.request))

    def check_count(self, n: int) -> None:
        """400 for no image, 413 for more than ``inference.max_images_per_request``."""
        limit = self.settings.max_images_per_request
        if n == 0:
            raise BadRequest("input: at least one image is required")
        if n > limit:
            raise PayloadTooLarge(f"input: {n} images, more than the limit of {limit} per request")

    def images(self, inputs: str | list[str]) -> list[bytes]:
        """The image bytes of one or more base64 texts or data: URIs, counted and size-checked."""
        items = [inputs] if isinstance(inputs, str) else inputs
        self.check_count(len(items))
        return [image_bytes_from_text(text, i, self.engine.limits) for i, text in enumerate(items)]

    def answer(
        self, model: LoadedModel, result: Result, images: list[bytes], privacy: Privacy
    ) -> dict[str, Any]:
        """Set the ``X-...`` headers (the revision, the guarantee, the timings) and return the
        fields every inference response has: model, revision, privacy, usage."""
        headers = self.response.headers
        headers["X-Model-Revision"] = model.commit
        self.state(privacy)
        headers["X-Queue-Ms"] = f"{result.queue_s * 1e3:.2f}"
        headers["X-Preprocess-Ms"] = f"{result.preprocess_s * 1e3:.2f}"
        headers["X-Inference-Ms"] = f"{result.forward_s * 1e3:.2f}"
        return {
            "model": model.repo_id,
            "revision": model.commit,
            "privacy": privacy,
            "usage": Usage(images=len(images)),
        }

    def state(self, privacy: Privacy) -> None:
        """Set the ``X-Privacy-*`` headers to ``privacy``, the guarantee of what the response's
        output depends on: ``X-Privacy-Caveat`` too where the epsilon assumes what the training
        did not meet."""
        headers = self.response.headers
        headers["X-Privacy-Epsilon"] = "none" if privacy.epsilon is None else repr(privacy.epsilon)
        headers["X-Privacy-Delta"] = repr(privacy.delta)
        if privacy.caveat is not None:
            headers["X-Privacy-Caveat"] = header_safe(privacy.caveat)
        elif "X-Privacy-Caveat" in headers:
            del headers["X-Privacy-Caveat"]


async def _call(
    request: Request, response: Response, who: Identity | None = Depends(caller)
) -> InferenceCall:
    # async, as caller: a plain function would go through FastAPI's thread pool
    return InferenceCall(request, response, who)


Call = Annotated[InferenceCall, Depends(_call)]
"""The parameter every inference route takes."""


def new_router() -> APIRouter:
    """A router of inference routes: under ``/v1``, documenting the errors they share."""
    return APIRouter(prefix="/v1", tags=["inference"], responses=ERRORS)
