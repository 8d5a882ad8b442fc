"""What the inference routers share (``api.py``, ``captions.py``): the request fields for a model
and its images, the privacy and usage blocks of a response, the caller, the model lookup, the
input checks and the response headers."""

from __future__ import annotations

from functools import partial
from typing import Annotated, Any

from fastapi import Request, Response
from pydantic import BaseModel, Field

from vip_hub.privacy.ledger import PrivacySummary, privacy_headline

from ..auth import Identity, check_read, identity, identity_or_anonymous, require_scope
from ..errors import BadRequest, PayloadTooLarge
from ..hub.common import store_of
from ..store.naming import NAME_PATTERN, REVISION_PATTERN
from .engine import InferenceEngine, Result, parse_model_ref
from .images import image_bytes_from_text
from .models import LoadedModel, Task

__all__ = [
    "ERRORS",
    "MODEL_PATTERN",
    "Image64",
    "ModelRef",
    "Privacy",
    "Usage",
    "caller",
    "check_count",
    "decode_texts",
    "disconnected",
    "engine_of",
    "open_model",
    "run_task",
    "set_headers",
]

MODEL_PATTERN = rf"^{NAME_PATTERN}/{NAME_PATTERN}(@{REVISION_PATTERN})?$"
ModelRef = Annotated[str, Field(pattern=MODEL_PATTERN, max_length=300, examples=["vip/vip-nano"])]
Image64 = Annotated[str, Field(min_length=1, description="base64 image bytes, or a data: URI")]


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


async def caller(request: Request) -> Identity | None:
    """The caller; with ``auth.protect_inference`` a read token is required, else an unknown
    token counts as anonymous (OpenAI clients send ``api_key="EMPTY"``). (``async``: it only
    reads memory, and FastAPI would run a plain function through its thread pool.)"""
    if request.app.state.settings.auth.protect_inference:
        return require_scope(identity(request), "read", "inference")
    return identity_or_anonymous(request)


async def disconnected(request: Request) -> None:
    """Return once the client has gone away (the body is read: the server's ``receive`` now
    waits for the disconnect, or for the response to complete)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def engine_of(request: Request) -> InferenceEngine:
    """The app's inference engine (``app.state.engine``)."""
    return request.app.state.engine


async def open_model(request: Request, ref: str, who: Identity | None) -> LoadedModel:
    """The model ``ref`` (``org/name[@revision]``) names, loaded, if ``who`` may read it."""
    store = store_of(request)
    repo_id, revision = parse_model_ref(ref)
    repo = store.get_repo(repo_id)
    check_read(repo.private, repo_id, who)
    return await engine_of(request).model(repo_id, store.resolve(repo_id, revision))


async def run_task(request: Request, model: LoadedModel, images: list[bytes], task: Task) -> Result:
    """Compute ``task`` on ``images`` through the model's batcher; given up if the client leaves."""
    return await engine_of(request).run(model, images, task, partial(disconnected, request))


def check_count(request: Request, n: int) -> None:
    """400 for no image, 413 for more than ``inference.max_images_per_request``."""
    limit = request.app.state.settings.inference.max_images_per_request
    if n == 0:
        raise BadRequest("input: at least one image is required")
    if n > limit:
        raise PayloadTooLarge(f"input: {n} images, more than the limit of {limit} per request")


def decode_texts(request: Request, inputs: str | list[str]) -> list[bytes]:
    """The image bytes of one or more base64 texts or data: URIs, counted and size-checked."""
    items = [inputs] if isinstance(inputs, str) else inputs
    check_count(request, len(items))
    limits = engine_of(request).limits
    return [image_bytes_from_text(text, i, limits) for i, text in enumerate(items)]


def set_headers(response: Response, model: LoadedModel, result: Result, privacy: Privacy) -> None:
    """The revision, the guarantee and the timings as ``X-...`` headers."""
    response.headers["X-Model-Revision"] = model.commit
    epsilon = "none" if privacy.epsilon is None else repr(privacy.epsilon)
    response.headers["X-Privacy-Epsilon"] = epsilon
    response.headers["X-Privacy-Delta"] = repr(privacy.delta)
    response.headers["X-Queue-Ms"] = f"{result.queue_s * 1e3:.2f}"
    response.headers["X-Preprocess-Ms"] = f"{result.preprocess_s * 1e3:.2f}"
    response.headers["X-Inference-Ms"] = f"{result.forward_s * 1e3:.2f}"
