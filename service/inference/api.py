"""``/v1/embeddings`` (JSON and multipart), ``/v1/classify`` and ``/v1/models``.

Every embedding or classification response names the model revision and its privacy
guarantee, in the body and in ``X-Model-Revision``, ``X-Privacy-Epsilon``,
``X-Privacy-Delta``, with ``X-Queue-Ms``, ``X-Preprocess-Ms`` and ``X-Inference-Ms`` timings.
"""

from __future__ import annotations

import base64
import json
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from fastapi import APIRouter, Depends, File, Form, Query, Request, Response, UploadFile
from pydantic import BaseModel, ConfigDict, Field

from vip_hub.artifacts import read_safetensors_header
from vip_hub.captioning import can_caption
from vip_hub.features import Pooling
from vip_hub.ledger import PrivacyLedger, PrivacySummary
from vip_hub.repo_format import (
    CONFIG_BLOCK,
    CONFIG_FILE,
    DEFAULT_BRANCH,
    HEAD_LABELS,
    LEDGER_FILE,
    META_POOLING,
    NAME_PATTERN,
    head_component,
    head_file,
    heads_in,
    privacy_headline,
)

from ..auth import (
    Identity,
    check_read,
    identity,
    identity_or_anonymous,
    private_namespaces,
    require_scope,
)
from ..errors import BadRequest, EntryNotFound, PayloadTooLarge
from ..hub.common import store_of
from .engine import InferenceEngine, Result, parse_model_ref
from .images import image_bytes_from_text
from .models import LoadedModel, Task

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["inference"])

_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_-])?"
MODEL_PATTERN = rf"^{_NAME}/{_NAME}(@[A-Za-z0-9][A-Za-z0-9_.-]{{0,127}})?$"
ModelRef = Annotated[str, Field(pattern=MODEL_PATTERN, max_length=300, examples=["vip/vip-nano"])]
Image64 = Annotated[str, Field(min_length=1, description="base64 image bytes, or a data: URI")]


class Privacy(BaseModel):
    """What a component's weights promise (``PrivacyLedger.summary``): a head's summary
    includes its encoder's stages."""

    epsilon: float | None = Field(description="the largest epsilon; 0 without private data; null when some "
                                              "private data was used without DP (no guarantee)")
    delta: float
    datasets: list[str] = Field(description="private datasets with a DP guarantee")
    accountant: str | None
    private_data: bool
    unprotected_datasets: list[str] = Field(description="private datasets used WITHOUT a guarantee")
    caveat: str | None = Field(description="what the epsilon assumes but the training did not meet (an imported "
                                           "release that shuffled instead of Poisson-sampling), else null")
    epsilon_without_amplification: float | None = Field(
        description="with a caveat: the epsilon that holds without amplification by sampling (PLD)")
    headline: str = Field(description="the guarantee in one line, as the card and the pages state it")

    @classmethod
    def of(cls, summary: PrivacySummary) -> "Privacy":
        return cls(**summary.to_dict(), headline=privacy_headline(summary))


class Usage(BaseModel):
    images: int


class EmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: ModelRef
    input: Image64 | list[Image64] = Field(description="one image or a list (base64 or data: URIs)")
    pooling: Pooling = "avg"
    normalize: bool = False
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="keep the first N dimensions")


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    revision: str
    pooling: Pooling
    privacy: Privacy
    usage: Usage


class ClassifyRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: ModelRef
    head: str = Field(pattern=f"^{NAME_PATTERN}$", description="a heads/<name>/ probe of the model")
    input: Image64 | list[Image64]
    top_k: int = Field(5, ge=1, le=1000)


class LabelScore(BaseModel):
    label: str
    score: float


class Classification(BaseModel):
    index: int
    labels: list[LabelScore]


class ClassifyPrivacy(BaseModel):
    encoder: Privacy
    head: Privacy = Field(description="the head's summary: its own stage(s) and its encoder's")


class ClassifyResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Classification]
    model: str
    revision: str
    head: str
    privacy: ClassifyPrivacy
    usage: Usage


class HeadDescription(BaseModel):
    name: str
    pooling: str
    labels: list[str]
    privacy: Privacy


class ModelDescription(BaseModel):
    id: str
    revision: str
    loaded: bool
    arch: str | None
    feature_dims: dict[str, int]
    heads: list[HeadDescription]
    captions: bool = Field(False, description="whether /v1/captions and /v1/zero-shot serve it (a DP-Cap repo "
                                              "with its text decoder and vocabulary)")
    privacy: Privacy


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelDescription]


_ERRORS: dict[int | str, dict[str, Any]] = {
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


async def _disconnected(request: Request) -> None:
    """Return once the client has gone away (the body is read: the server's ``receive`` now
    waits for the disconnect, or for the response to complete)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def engine_of(request: Request) -> InferenceEngine:
    return request.app.state.engine


async def _model(request: Request, ref: str, who: Identity | None) -> LoadedModel:
    store = store_of(request)
    repo_id, revision = parse_model_ref(ref)
    repo = store.get_repo(repo_id)
    check_read(repo.private, repo_id, who)
    return await engine_of(request).model(repo_id, store.resolve(repo_id, revision))


def _check_count(request: Request, n: int) -> None:
    limit = request.app.state.settings.inference.max_images_per_request
    if n == 0:
        raise BadRequest("input: at least one image is required")
    if n > limit:
        raise PayloadTooLarge(f"input: {n} images, more than the limit of {limit} per request")


def _decode_texts(request: Request, inputs: str | list[str]) -> list[bytes]:
    items = [inputs] if isinstance(inputs, str) else inputs
    _check_count(request, len(items))
    limits = engine_of(request).limits
    return [image_bytes_from_text(text, i, limits) for i, text in enumerate(items)]


def _headers(response: Response, model: LoadedModel, result: Result, privacy: Privacy) -> None:
    response.headers["X-Model-Revision"] = model.commit
    response.headers["X-Privacy-Epsilon"] = "none" if privacy.epsilon is None else repr(privacy.epsilon)
    response.headers["X-Privacy-Delta"] = repr(privacy.delta)
    response.headers["X-Queue-Ms"] = f"{result.queue_s * 1e3:.2f}"
    response.headers["X-Preprocess-Ms"] = f"{result.preprocess_s * 1e3:.2f}"
    response.headers["X-Inference-Ms"] = f"{result.forward_s * 1e3:.2f}"


async def _embed(request: Request, response: Response, who: Identity | None, ref: str, images: list[bytes],
                 pooling: Pooling, normalize: bool, encoding_format: str, dimensions: int | None) -> EmbeddingsResponse:
    model = await _model(request, ref, who)
    width = model.encoder.feature_dim(pooling)
    if dimensions is not None and dimensions > width:
        raise BadRequest(f"dimensions: {dimensions} is more than the {width} of {pooling} embeddings")
    result = await engine_of(request).run(model, images, Task(poolings=(pooling,)), partial(_disconnected, request))
    vectors = torch.cat([out[pooling] for out in result.outputs])
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    if normalize:
        vectors = torch.nn.functional.normalize(vectors, dim=-1)
    privacy = Privacy.of(model.ledger.summary())
    _headers(response, model, result, privacy)
    data = [Embedding(index=i, embedding=_encode(v, encoding_format)) for i, v in enumerate(vectors)]
    return EmbeddingsResponse(data=data, model=model.repo_id, revision=model.commit, pooling=pooling,
                              privacy=privacy, usage=Usage(images=len(images)))


def _encode(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()


@router.post("/embeddings", response_model=EmbeddingsResponse, responses=_ERRORS, summary="Embed images (JSON)")
async def embeddings(payload: EmbeddingsRequest, request: Request, response: Response,
                     who: Identity | None = Depends(caller)) -> EmbeddingsResponse:
    images = _decode_texts(request, payload.input)
    return await _embed(request, response, who, payload.model, images, payload.pooling, payload.normalize,
                        payload.encoding_format, payload.dimensions)


@router.post("/embeddings/files", response_model=EmbeddingsResponse, responses=_ERRORS,
             summary="Embed uploaded image files (multipart form)")
async def embeddings_files(
    request: Request,
    response: Response,
    model: Annotated[str, Form(max_length=300, pattern=MODEL_PATTERN)],
    files: Annotated[list[UploadFile], File(description="image files, in order")],
    pooling: Annotated[Pooling, Form()] = "avg",
    normalize: Annotated[bool, Form()] = False,
    encoding_format: Annotated[Literal["float", "base64"], Form()] = "float",
    dimensions: Annotated[int | None, Form(ge=1)] = None,
    who: Identity | None = Depends(caller),
) -> EmbeddingsResponse:
    _check_count(request, len(files))
    limit = engine_of(request).limits.max_bytes
    images = []
    for i, f in enumerate(files):
        data = await f.read(limit + 1)
        if len(data) > limit:
            raise PayloadTooLarge(f"input[{i}]: image larger than {limit} bytes")
        images.append(data)
    return await _embed(request, response, who, model, images, pooling, normalize, encoding_format, dimensions)


@router.post("/classify", response_model=ClassifyResponse, responses=_ERRORS,
             summary="Classify images with a linear-probe head")
async def classify(payload: ClassifyRequest, request: Request, response: Response,
                   who: Identity | None = Depends(caller)) -> ClassifyResponse:
    images = _decode_texts(request, payload.input)
    model = await _model(request, payload.model, who)
    if payload.head not in model.heads:
        known = ", ".join(sorted(model.heads)) or "none"
        raise EntryNotFound(f"{model.repo_id} has no head {payload.head!r} (heads: {known})")
    labels = model.heads[payload.head][1].labels
    result = await engine_of(request).run(model, images, Task(head=payload.head), partial(_disconnected, request))
    probs = torch.cat(result.outputs)
    k = min(payload.top_k, len(labels))
    scores, indices = probs.topk(k, dim=-1)
    data = [
        Classification(index=i, labels=[LabelScore(label=labels[j], score=float(s)) for s, j in zip(row_s, row_i)])
        for i, (row_s, row_i) in enumerate(zip(scores.tolist(), indices.tolist()))
    ]
    privacy = ClassifyPrivacy(encoder=Privacy.of(model.ledger.summary()),
                              head=Privacy.of(model.ledger.summary(head_component(payload.head))))
    _headers(response, model, result, privacy.encoder)
    return ClassifyResponse(data=data, model=model.repo_id, revision=model.commit, head=payload.head,
                            privacy=privacy, usage=Usage(images=len(images)))


@router.get("/models", response_model=ModelList, summary="Available and loaded models")
def list_models(request: Request, who: Identity | None = Depends(caller)) -> ModelList:
    store = store_of(request)
    rows = store.list_models(include_private=private_namespaces(who),
                             limit=request.app.state.settings.hub.page_size)
    return ModelList(data=[_describe(request, repo.repo_id, commit.sha) for repo, commit in rows])


@router.get("/models/{org}/{name}", response_model=ModelDescription, responses=_ERRORS, summary="One model")
def get_model(org: str, name: str, request: Request, revision: str = Query(DEFAULT_BRANCH, max_length=128),
              who: Identity | None = Depends(caller)) -> ModelDescription:
    store = store_of(request)
    repo = store.get_repo(f"{org}/{name}")
    check_read(repo.private, repo.repo_id, who)
    return _describe(request, repo.repo_id, store.resolve(repo.repo_id, revision))


def _describe(request: Request, repo_id: str, commit: str) -> ModelDescription:
    """From memory when loaded; otherwise from the store's index and files (nothing loaded)."""
    store = store_of(request)
    loaded = next((m for m in engine_of(request).loaded() if (m.repo_id, m.commit) == (repo_id, commit)), None)
    tree = store.tree(repo_id, commit)
    config = json.loads(store.blob_path(tree[CONFIG_FILE]).read_bytes())
    ledger = loaded.ledger if loaded else PrivacyLedger.parse(store.blob_path(tree[LEDGER_FILE]).read_bytes())
    heads = []
    for name in heads_in(tree):
        labels_entry = tree.get(head_file(name, HEAD_LABELS))
        labels = json.loads(store.blob_path(labels_entry).read_bytes()) if labels_entry else []
        pooling = (loaded.heads[name][1].pooling if loaded and name in loaded.heads
                   else _head_pooling(store.blob_path(tree[head_file(name)])))
        heads.append(HeadDescription(name=name, pooling=pooling, labels=labels,
                                     privacy=Privacy.of(ledger.summary(head_component(name)))))
    meta = config.get(CONFIG_BLOCK) or {}
    return ModelDescription(
        id=repo_id, revision=commit, loaded=loaded is not None, arch=meta.get("arch"),
        feature_dims=meta.get("feature_dims") or {}, heads=heads, privacy=Privacy.of(ledger.summary()),
        captions=loaded.captions is not None if loaded else can_caption(tree),
    )


def _head_pooling(path: Path) -> str:
    return (read_safetensors_header(path)[0].get("__metadata__") or {}).get(META_POOLING, "vip")

