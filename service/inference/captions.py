"""``/v1/captions`` and ``/v1/zero-shot``: what a DP-Cap repo with its text decoder and vocabulary
serves, batched through the model's batcher like embeddings, with the same limits, errors,
timing headers and privacy block (``PrivacyLedger.summary``: the decoder was trained in the
encoder's stages)."""

from __future__ import annotations

from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from vip_hub.models.text_decoder import DEFAULT_PROMPT

from ..errors import BadRequest, PayloadTooLarge
from ..settings import MAX_CAPTION_TOKENS
from . import common
from .models import LoadedModel, Task

__all__ = ["router"]

router = common.new_router()

Label = Annotated[
    str, Field(min_length=1, max_length=200, description="a class name, e.g. 'golden retriever'")
]


class CaptionsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: common.ModelRef
    input: common.Images
    max_tokens: int | None = Field(
        None,
        ge=1,
        le=MAX_CAPTION_TOKENS,
        description="most tokens per caption (default: the "
        "server's inference.max_caption_tokens, within the model's maximum)",
    )


class Caption(BaseModel):
    object: Literal["caption"] = "caption"
    index: int
    caption: str


class CaptionsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Caption]
    model: str
    revision: str
    privacy: common.Privacy
    usage: common.Usage


class ZeroShotRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: common.ModelRef
    input: common.Images
    labels: list[Label] = Field(
        min_length=1, description="the candidate classes (at most inference.max_labels)"
    )
    prompt: str = Field(DEFAULT_PROMPT, max_length=200, description="text before each label")
    top_k: common.TopK = 5


class LabelLoss(BaseModel):
    label: str
    loss: float = Field(description="caption loss of the prompt and label (smaller is more likely)")
    score: float = Field(description="softmax of the negated losses over the labels")


class ZeroShotResult(BaseModel):
    index: int
    label: str = Field(description="the prediction: the label with the smallest loss")
    labels: list[LabelLoss]


class ZeroShotResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[ZeroShotResult]
    model: str
    revision: str
    privacy: common.Privacy
    usage: common.Usage


async def _captioning_model(call: common.InferenceCall, ref: str) -> LoadedModel:
    model = await call.model(ref)
    if model.captions is None:
        raise BadRequest(
            f"model: {model.repo_id} cannot caption (it is not a DP-Cap repo with a text decoder "
            "and a vocabulary)"
        )
    return model


@router.post("/captions", summary="Caption images (greedy decoding, DP-Cap repos)")
async def captions(payload: CaptionsRequest, call: common.Call) -> CaptionsResponse:
    images = call.images(payload.input)
    model = await _captioning_model(call, payload.model)
    assert model.captions is not None
    limit = min(call.settings.max_caption_tokens, model.captions.max_tokens)
    tokens = limit if payload.max_tokens is None else payload.max_tokens
    if tokens > limit:
        raise BadRequest(
            f"max_tokens: {tokens} is more than the limit of {limit} for {model.repo_id}"
        )
    result = await call.run(model, images, Task(caption_tokens=tokens))
    texts = [caption for out in result.outputs for caption in out]
    privacy = common.Privacy.of(model.ledger.summary())
    return CaptionsResponse(
        data=[Caption(index=i, caption=c) for i, c in enumerate(texts)],
        **call.answer(model, result, images, privacy),
    )


@router.post(
    "/zero-shot", summary="Classify images among label texts by caption likelihood (DP-Cap repos)"
)
async def zero_shot(payload: ZeroShotRequest, call: common.Call) -> ZeroShotResponse:
    limit = call.settings.max_labels
    if len(payload.labels) > limit:
        raise PayloadTooLarge(
            f"labels: {len(payload.labels)} labels, more than the limit of {limit} per request"
        )
    images = call.images(payload.input)
    passes, queue = len(images) * len(payload.labels), call.settings.max_queue_images
    if passes > queue:  # each label is scored for each image: a text-decoder pass each
        raise PayloadTooLarge(
            f"{len(images)} images x {len(payload.labels)} labels: {passes} text-decoder "
            f"passes, more than the {queue} a model's queue holds "
            "(inference.max_queue_images); send fewer images or labels"
        )
    model = await _captioning_model(call, payload.model)
    assert model.captions is not None
    texts = model.captions.label_texts(
        payload.labels, payload.prompt
    )  # ConfigError (400) names a bad label
    result = await call.run(model, images, Task(texts=texts))
    losses = torch.cat(result.outputs)
    scores = torch.softmax(-losses, dim=-1)
    k = min(payload.top_k, len(payload.labels))
    data = []
    for i, row in enumerate(losses):
        order = row.argsort()[:k].tolist()
        ranked = [
            LabelLoss(label=payload.labels[j], loss=float(row[j]), score=float(scores[i, j]))
            for j in order
        ]
        data.append(ZeroShotResult(index=i, label=ranked[0].label, labels=ranked))
    privacy = common.Privacy.of(model.ledger.summary())
    return ZeroShotResponse(data=data, **call.answer(model, result, images, privacy))
