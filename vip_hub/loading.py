"""``vip_hub.load_encoder``: a released encoder with its preprocessing and its ledger."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import timm
import torch
from PIL import Image
from timm.data import create_transform, resolve_data_config
from timm.models.vision_transformer import VisionTransformer

from .errors import MissingInputError
from .features import Pooling, extract_features, feature_dim
from .ledger import PrivacyLedger, PrivacySummary
from .models import EncoderSpec
from .repo import read_config
from .repo_format import LEDGER_FILE
from .verify import verify_repo

__all__ = ["Encoder", "load_encoder", "resolve_source"]


@dataclass
class Encoder:
    """A loaded encoder: the timm model (eval mode), its transform, its ledger and config."""

    model: VisionTransformer
    transform: Callable[[Image.Image], torch.Tensor]
    ledger: PrivacyLedger
    config: dict[str, Any]
    spec: EncoderSpec
    path: Path

    @property
    def privacy(self) -> PrivacySummary:
        return self.ledger.summary()

    def feature_dim(self, pooling: Pooling = "avg") -> int:
        return feature_dim(self.model, pooling)

    def preprocess(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """Apply the model's pretrained_cfg transform to PIL images, as a batch."""
        return torch.stack([self.transform(img.convert("RGB")) for img in images])

    @torch.inference_mode()
    def embed(
        self, images: Sequence[Image.Image] | torch.Tensor, pooling: Pooling = "avg", batch_size: int = 64
    ) -> torch.Tensor:
        """Embeddings (N, dim) for PIL images or an already preprocessed batch."""
        device = next(self.model.parameters()).device
        chunks = []
        for start in range(0, len(images), batch_size):
            part = images[start : start + batch_size]
            batch = part if isinstance(part, torch.Tensor) else self.preprocess(part)
            chunks.append(extract_features(self.model, batch.to(device), pooling).float().cpu())
        if not chunks:
            return torch.empty(0, self.feature_dim(pooling))
        return torch.cat(chunks)


def resolve_source(source: str | os.PathLike[str], revision: str | None = None) -> Path:
    """A local folder for ``source``: a path (optionally ``local-dir:``), or a hub repo id
    (optionally ``hf-hub:``), downloaded with huggingface_hub (which honours ``HF_ENDPOINT``)."""
    text = os.fspath(source)
    if text.startswith("local-dir:") or Path(text).exists():
        path = Path(text.removeprefix("local-dir:"))
        if not path.is_dir():
            raise MissingInputError(f"{path} is not a repo folder")
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError

    repo_id, _, rev = text.removeprefix("hf-hub:").partition("@")
    try:
        return Path(snapshot_download(repo_id, revision=revision or rev or None))
    except (HfHubHTTPError, HFValidationError) as e:
        raise MissingInputError(f"{text} is neither a folder nor a repo on the hub: {' '.join(str(e).split())}") from None


def load_encoder(
    source: str | os.PathLike[str],
    *,
    revision: str | None = None,
    verify: bool = True,
    device: str | torch.device = "cpu",
) -> Encoder:
    """Load a released encoder from a folder or a hub repo id.

    With ``verify`` (the default) the repo must pass ``vip-hub verify`` first; a failure
    raises a VerificationError subclass naming every problem. The model is built by timm alone from
    config.json, exactly as ``timm.create_model("local-dir:...", pretrained=True)`` would.
    """
    path = resolve_source(source, revision)
    if verify:
        ledger = verify_repo(path).raise_for_problems().ledger
    else:
        ledger = PrivacyLedger.parse((path / LEDGER_FILE).read_bytes())
    config = read_config(path)
    model = timm.create_model(f"local-dir:{path}", pretrained=True).eval().to(device)
    transform = create_transform(**resolve_data_config({}, model=model))
    return Encoder(model, transform, ledger, config, EncoderSpec.from_config(config), path)
