"""``/v1/embeddings`` (JSON and multipart), ``/v1/classify`` and ``/v1/models``.

Every embedding or classification response names the model revision and its privacy
guarantee, in the body and in ``X-Model-Revision``, ``X-Privacy-Epsilon``, ``X-Privacy-Delta``
(and ``X-Privacy-Caveat``; a classification's the head's), with ``X-Queue-Ms``,
``X-Preprocess-Ms`` and ``X-Inference-Ms`` timings.
"""

from __future__ import annotations

import base64
import json
from typing import Annotated, Literal

import torch
from fastapi import File, Form, Query, UploadFile
from pydantic import BaseModel, ConfigDict, Field

from vip_hub.models.features import Pooling
from vip_hub.privacy.ledger import PrivacyLedger
from vip_hub.repo.files import can_caption
from vip_hub.repo.heads import head_pooling
from vip_hub.repo.verify import mode_widths
from vip_hub.repo_format import (
    CONFIG_BLOCK,
    CONFIG_FILE,
    DEFAULT_BRANCH,
    HEAD_FOLDER_SHOWN,
    HEAD_LABELS,
    LEDGER_FILE,
    NAME_PATTERN,
    head_component,
    head_file,
    heads_in,
)

from ..auth import check_read, private_namespaces
from ..errors import BadRequest, EntryNotFound, PayloadTooLarge
from ..hub.common import MAX_OFFSET, page_size, store_of
from ..store.naming import MAX_REVISION_LENGTH
from .common import (
    MAX_MODEL_REF_LENGTH,
    MODEL_PATTERN,
    Call,
    Images,
    InferenceCall,
    ModelRef,
    Privacy,
    TopK,
    Usage,
    new_router,
)
from .models import Task

__all__ = ["router"]

router = new_router()
MAX_POOLING_LENGTH = 64
POOLING_HELP = (
    "feature mode: avg, cls, a family's own (vip, dpcap), a spatial mode the repo declares "
    "(spatial-b<blocks>-g<grid>), or pixels (the preprocessed image, channels averaged); "
    "/v1/models lists each model's feature_dims"
)


class EmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: ModelRef
    input: Images
    pooling: Pooling = Field("avg", max_length=MAX_POOLING_LENGTH, description=POOLING_HELP)
    normalize: bool = False
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="keep the first N dimensions")
    user: str | None = Field(
        None, max_length=256, description="OpenAI's end-user identifier: accepted, not kept"
    )


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
    head: str = Field(
        pattern=f"^{NAME_PATTERN}$", description=f"a {HEAD_FOLDER_SHOWN} probe of the model"
    )
    input: Images
    top_k: TopK = 5


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
    captions: bool = Field(
        False,
        description="whether /v1/captions and /v1/zero-shot serve it (a DP-Cap repo "
        "with its text decoder and vocabulary)",
    )
    privacy: Privacy


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelDescription]
    has_more: bool = Field(
        False, description="more models follow: ask again with offset + len(data)"
    )


async def _embed(
    call: Call,
    ref: str,
    images: list[bytes],
    pooling: Pooling,
    normalize: bool,
    encoding_format: str,
    dimensions: int | None,
) -> EmbeddingsResponse:
    model = await call.model(ref)
    width = model.encoder.feature_dim(pooling)
    if dimensions is not None and dimensions > width:
        raise BadRequest(
            f"dimensions: {dimensions} is more than the {width} of {pooling} embeddings"
        )
    result = await call.run(model, images, Task(poolings=(pooling,)))
    vectors = torch.cat([out[pooling] for out in result.outputs])
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    if normalize:
        vectors = torch.nn.functional.normalize(vectors, dim=-1)
    data = [
        Embedding(index=i, embedding=_encode(v, encoding_format)) for i, v in enumerate(vectors)
    ]
    privacy = Privacy.of(model.ledger.summary())
    return EmbeddingsResponse(
        data=data, pooling=pooling, **call.answer(model, result, images, privacy)
    )


def _encode(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()


@router.post("/embeddings", summary="Embed images (JSON)")
async def embeddings(payload: EmbeddingsRequest, call: Call) -> EmbeddingsResponse:
    images = call.images(payload.input)
    return await _embed(
        call,
        payload.model,
        images,
        payload.pooling,
        payload.normalize,
        payload.encoding_format,
        payload.dimensions,
    )


@router.post("/embeddings/files", summary="Embed uploaded image files (multipart form)")
async def embeddings_files(
    call: Call,
    model: Annotated[str, Form(max_length=MAX_MODEL_REF_LENGTH, pattern=MODEL_PATTERN)],
    files: Annotated[list[UploadFile], File(description="image files, in order")],
    pooling: Annotated[
        Pooling, Form(max_length=MAX_POOLING_LENGTH, description=POOLING_HELP)
    ] = "avg",
    normalize: Annotated[bool, Form()] = False,
    encoding_format: Annotated[Literal["float", "base64"], Form()] = "float",
    dimensions: Annotated[int | None, Form(ge=1)] = None,
) -> EmbeddingsResponse:
    call.check_count(len(files))
    limit = call.engine.limits.max_bytes
    images = []
    for i, f in enumerate(files):
        data = await f.read(limit + 1)
        if len(data) > limit:
            raise PayloadTooLarge(f"input[{i}]: image larger than {limit} bytes")
        images.append(data)
    return await _embed(call, model, images, pooling, normalize, encoding_format, dimensions)


@router.post("/classify", summary="Classify images with a linear-probe head")
async def classify(payload: ClassifyRequest, call: Call) -> ClassifyResponse:
    images = call.images(payload.input)
    model = await call.model(payload.model)
    if payload.head not in model.heads:
        known = ", ".join(sorted(model.heads)) or "none"
        raise EntryNotFound(f"{model.repo_id} has no head {payload.head!r} (heads: {known})")
    labels = model.heads[payload.head][1].labels
    result = await call.run(model, images, Task(head=payload.head))
    probs = torch.cat(result.outputs)
    k = min(payload.top_k, len(labels))
    scores, indices = probs.topk(k, dim=-1)
    data = [
        Classification(
            index=i,
            labels=[
                LabelScore(label=labels[j], score=float(s))
                for s, j in zip(row_s, row_i, strict=True)
            ],
        )
        for i, (row_s, row_i) in enumerate(zip(scores.tolist(), indices.tolist(), strict=True))
    ]
    fields = call.answer(model, result, images, Privacy.of(model.ledger.summary()))
    privacy = ClassifyPrivacy(
        encoder=fields.pop("privacy"),
        head=Privacy.of(model.ledger.summary(head_component(payload.head))),
    )
    call.state(privacy.head)  # the labels are the head's: its guarantee, its encoder's within
    return ClassifyResponse(data=data, head=payload.head, privacy=privacy, **fields)


@router.get("/models", summary="Available and loaded models")
def list_models(
    call: Call,
    limit: int | None = Query(None, ge=1, description="at most hub.page_size, its default"),
    offset: int = Query(0, ge=0, le=MAX_OFFSET, description="models to skip, newest first"),
) -> ModelList:
    size = page_size(call.request, limit)
    rows = store_of(call.request).list_models(
        include_private=private_namespaces(call.who), limit=size + 1, offset=offset
    )
    return ModelList(
        data=[_describe(call, repo.repo_id, commit.sha) for repo, commit in rows[:size]],
        has_more=len(rows) > size,
    )


@router.get("/models/{org}/{name}", summary="One model")
def get_model(
    org: str,
    name: str,
    call: Call,
    revision: str = Query(DEFAULT_BRANCH, max_length=MAX_REVISION_LENGTH),
) -> ModelDescription:
    store = store_of(call.request)
    repo = store.get_repo(f"{org}/{name}")
    check_read(repo.private, repo.repo_id, call.who)
    return _describe(call, repo.repo_id, store.resolve(repo.repo_id, revision))


def _describe(call: InferenceCall, repo_id: str, commit: str) -> ModelDescription:
    """From memory when loaded; otherwise from the store's index and files (nothing loaded)."""
    store = store_of(call.request)
    loaded = next(
        (m for m in call.engine.loaded() if (m.repo_id, m.commit) == (repo_id, commit)), None
    )
    tree = store.tree(repo_id, commit)
    config = json.loads(store.blob_path(tree[CONFIG_FILE]).read_bytes())
    ledger = (
        loaded.ledger
        if loaded
        else PrivacyLedger.parse(store.blob_path(tree[LEDGER_FILE]).read_bytes())
    )
    heads = []
    for name in heads_in(tree):
        labels_entry = tree.get(head_file(name, HEAD_LABELS))
        labels = json.loads(store.blob_path(labels_entry).read_bytes()) if labels_entry else []
        pooling = (
            loaded.heads[name][1].pooling
            if loaded and name in loaded.heads
            else head_pooling(store.blob_path(tree[head_file(name)]))
        )
        heads.append(
            HeadDescription(
                name=name,
                pooling=pooling,
                labels=labels,
                privacy=Privacy.of(ledger.summary(head_component(name))),
            )
        )
    meta = config.get(CONFIG_BLOCK) or {}
    return ModelDescription(
        id=repo_id,
        revision=commit,
        loaded=loaded is not None,
        arch=meta.get("arch"),
        feature_dims=mode_widths(config),
        heads=heads,
        privacy=Privacy.of(ledger.summary()),
        captions=loaded.captions is not None if loaded else can_caption(tree),
    )
