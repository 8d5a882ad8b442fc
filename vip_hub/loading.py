"""``vip_hub.load_encoder``: a released encoder with its preprocessing and its ledger; and
``load_captioner``: a DP-Cap repo that captions (the encoder, its text decoder, its vocabulary)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast, overload

import timm
import torch
from PIL import Image
from timm.data import create_transform, resolve_data_config
from timm.models.vision_transformer import VisionTransformer

from .errors import ConfigError, MissingInputError, RepoFormatError
from .hub_client import hub_errors
from .images import to_rgb
from .models.encoders import EncoderSpec
from .models.features import (
    PIXELS,
    POOLINGS,
    SPATIAL_PATTERN,
    SPATIAL_SYNTAX,
    Pooling,
    extract_features,
    feature_dim,
)
from .models.text_decoder import DEFAULT_PROMPT, Captioner, ImageMemory, TextDecoder
from .models.tokenizer import CaptionTokenizer
from .privacy.ledger import PrivacyLedger, PrivacySummary
from .repo.files import (
    can_caption,
    check_feature_dims,
    declared_spatial,
    load_image_memory,
    load_text_decoder,
    read_config,
)
from .repo.verify import (
    check_loaded_decoder_config,
    check_loaded_tensors,
    verified_bytes,
    verify_repo,
)
from .repo_format import CONFIG_FILE, TEXT_DECODER_FILE, VOCAB_FILE, WEIGHTS_FILE

__all__ = ["CaptioningModel", "Encoder", "load_captioner", "load_encoder", "resolve_source"]


@dataclass
class Encoder:
    """A loaded encoder: the timm model (eval mode), its transform, its ledger and config, and
    (DP-Cap) the image-memory weights of its text decoder, which the ``dpcap`` mode needs."""

    model: VisionTransformer
    transform: Callable[[Image.Image], torch.Tensor]
    data_config: Mapping[str, Any]
    """What built ``transform`` (timm's ``resolve_data_config``: size, interpolation, crop, mean,
    std): encoders whose data configurations are equal preprocess an image alike."""
    ledger: PrivacyLedger
    config: dict[str, Any]
    spec: EncoderSpec
    path: Path
    memory: ImageMemory | None = None
    verified: bool = False
    """Whether the repo verified and the weights loaded are the ones its ledger binds."""

    @property
    def privacy(self) -> PrivacySummary:
        return self.ledger.summary()

    @property
    def poolings(self) -> tuple[Pooling, ...]:
        """The feature modes this repo offers: the encoder's (``encoder_poolings``), then
        ``pixels``."""
        return (*self.encoder_poolings, PIXELS)

    @property
    def encoder_poolings(self) -> tuple[Pooling, ...]:
        """The feature modes that read the encoder (what a mode is chosen among): its family's
        (``dpcap`` only with the decoder weights), then the spatial modes its timm configuration
        declares."""
        family = self.spec.family.offered_poolings(self.memory is not None)
        return family + declared_spatial(self.config)

    @property
    def can_caption(self) -> bool:
        """Whether the repo carries a text decoder and its vocabulary
        (:func:`load_captioner`)."""
        return self.spec.family.captions and can_caption(os.listdir(self.path))

    def check_pooling(self, pooling: str) -> None:
        """Raise ConfigError, naming the modes this repo offers, unless it offers ``pooling``."""
        if pooling in self.poolings:
            return
        if pooling in self.spec.family.poolings:
            why = f"this repo has no {TEXT_DECODER_FILE}"
        elif pooling in POOLINGS:
            why = f"{self.spec.family.title} encoders offer {', '.join(self.spec.family.poolings)}"
        elif SPATIAL_PATTERN.fullmatch(pooling):
            why = f"its {CONFIG_FILE}'s feature_dims does not declare this spatial mode"
        else:
            why = f"unknown feature mode (fixed: {', '.join(POOLINGS)}; spatial: {SPATIAL_SYNTAX})"
        raise ConfigError(
            f"feature mode {pooling!r} is not available for {self.spec.arch}: {why} "
            f"(this repo offers {', '.join(self.poolings)})"
        )

    def feature_dim(self, pooling: Pooling = "avg") -> int:
        self.check_pooling(pooling)
        return feature_dim(self.model, pooling, self.memory)

    def features(
        self, images: torch.Tensor, poolings: tuple[Pooling, ...]
    ) -> dict[Pooling, torch.Tensor]:
        """Several feature modes of a preprocessed batch (on the model's device), one forward
        pass."""
        for mode in poolings:
            self.check_pooling(mode)
        return extract_features(self.model, images, poolings, self.memory)

    def preprocess(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """Apply the model's pretrained_cfg transform to PIL images, as a batch; each made RGB
        as the service decodes it (``vip_hub.images.to_rgb``: EXIF orientation, wide greyscale)."""
        return torch.stack([self.transform(to_rgb(img)) for img in images])

    @overload
    def embed(
        self,
        images: Sequence[Image.Image] | torch.Tensor,
        pooling: Pooling = "avg",
        batch_size: int = 64,
    ) -> torch.Tensor: ...

    @overload
    def embed(
        self,
        images: Sequence[Image.Image] | torch.Tensor,
        pooling: tuple[Pooling, ...],
        batch_size: int = 64,
    ) -> dict[Pooling, torch.Tensor]: ...

    @torch.inference_mode()
    def embed(
        self,
        images: Sequence[Image.Image] | torch.Tensor,
        pooling: Pooling | tuple[Pooling, ...] = "avg",
        batch_size: int = 64,
    ) -> torch.Tensor | dict[Pooling, torch.Tensor]:
        """Embeddings (N, dim) for PIL images or an already preprocessed batch; a tuple of modes
        gives a dict of them, one forward pass per batch."""
        modes = (pooling,) if isinstance(pooling, str) else tuple(pooling)
        for mode in modes:
            self.check_pooling(mode)
        device = next(self.model.parameters()).device
        chunks: dict[Pooling, list[torch.Tensor]] = {m: [] for m in modes}
        for start in range(0, len(images), batch_size):
            part = images[start : start + batch_size]
            batch = part if isinstance(part, torch.Tensor) else self.preprocess(part)
            for mode, v in self.features(batch.to(device), modes).items():
                chunks[mode].append(v.float().cpu())
        out = {
            m: torch.cat(c) if c else torch.empty(0, self.feature_dim(m)) for m, c in chunks.items()
        }
        return out[modes[0]] if isinstance(pooling, str) else out


def resolve_source(source: str | os.PathLike[str], revision: str | None = None) -> Path:
    """A local folder for ``source``: a path (optionally ``local-dir:``; no revision), or a hub
    repo id (optionally ``hf-hub:``, ``@revision``), downloaded with huggingface_hub (which honours
    ``HF_ENDPOINT``)."""
    text = os.fspath(source)
    if text.startswith("local-dir:") or Path(text).exists():
        path = Path(text.removeprefix("local-dir:"))
        if revision:
            raise ConfigError(f"{path} is a folder: it has no revision {revision!r}")
        if not path.is_dir():
            raise MissingInputError(f"{path} is not a repo folder")
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    repo_id, at, rev = text.removeprefix("hf-hub:").partition("@")
    if at and revision and revision != rev:
        raise ConfigError(f"{text} pins revision {rev!r} but revision {revision!r} was given too")
    revision = revision or rev or None
    where = f"{text} at revision {revision!r}" if revision and not at else text
    with hub_errors(f"downloading {where}"):  # what is not the repo's absence
        try:
            return Path(snapshot_download(repo_id, revision=revision))
        except (HfHubHTTPError, HFValidationError, LocalEntryNotFoundError) as e:
            raise MissingInputError(
                f"{where} is neither a folder nor a repo on the hub: {' '.join(str(e).split())}"
            ) from None


def load_encoder(
    source: str | os.PathLike[str],
    *,
    revision: str | None = None,
    verify: bool = True,
    device: str | torch.device = "cpu",
) -> Encoder:
    """Load a released encoder from a folder or a hub repo id.

    With ``verify`` (the default) the repo must pass ``vip-hub verify`` first; a failure
    raises a VerificationError subclass naming every problem, and the tensors loaded afterwards
    (the model's, the text decoder's) must be the ones the verified ledger binds (else a
    TamperedFileError: a file replaced after verification), and the configuration is the verified
    bytes, read once. The model is built by timm alone from that configuration, exactly as
    ``timm.create_model("local-dir:...", pretrained=True)`` would.
    """
    path = resolve_source(source, revision)
    config_bytes = None
    if verify:
        ledger = verify_repo(path).raise_for_problems().ledger
        assert ledger is not None  # a report without problems has read the ledger
        config_bytes = verified_bytes(ledger, CONFIG_FILE, path / CONFIG_FILE)
        config = json.loads(config_bytes)  # verify parsed these very bytes
    else:
        ledger = PrivacyLedger.read(path)
        config = read_config(path)
    spec = EncoderSpec.from_config(config)
    model = _timm_model(path, config_bytes)
    if verify:  # timm read the weights again: they must be the ones verified
        check_loaded_tensors(ledger, WEIGHTS_FILE, path / WEIGHTS_FILE, model.state_dict())
    model = model.to(device)
    check_feature_dims(config, model)
    data_config = resolve_data_config({}, model=model)
    transform = create_transform(**data_config)
    memory = None
    if spec.family.captions and (path / TEXT_DECODER_FILE).is_file():
        if verify:  # the memory is part of the file's digest: load all of it to check it
            memory = _text_decoder(path, (ledger, config), "cpu").memory.to(device)
        else:
            memory = load_image_memory(path / TEXT_DECODER_FILE, device)
    return Encoder(
        model, transform, data_config, ledger, config, spec, path, memory, verified=verify
    )


def _timm_model(path: Path, config_bytes: bytes | None) -> VisionTransformer:
    """timm's model of the repo folder ``path``; given ``config_bytes`` (the verified
    configuration), timm reads them from a private folder beside a link to the repo's weights, so
    a configuration replaced in the repo after verification is never read; RepoFormatError
    naming the weights file when its tensors are not those of the configured model."""
    try:
        if config_bytes is None:
            model = timm.create_model(f"local-dir:{path}", pretrained=True)
        else:
            with tempfile.TemporaryDirectory(prefix="vip-hub-load-") as tmp:
                (Path(tmp) / CONFIG_FILE).write_bytes(config_bytes)
                (Path(tmp) / WEIGHTS_FILE).symlink_to((path / WEIGHTS_FILE).resolve())
                model = timm.create_model(f"local-dir:{tmp}", pretrained=True)
    except RuntimeError as e:  # torch's load_state_dict: missing, unexpected or misshapen tensors
        raise RepoFormatError(
            f"{path / WEIGHTS_FILE}: not the tensors of the model {CONFIG_FILE} configures "
            f"({' '.join(str(e).split())})"
        ) from None
    # a released repo's configuration names a VisionTransformer (timm types it as a Module)
    return cast(VisionTransformer, model.eval())


def _text_decoder(
    path: Path, verified: tuple[PrivacyLedger, Mapping[str, Any]] | None, device: str | torch.device
) -> TextDecoder:
    """The repo's text decoder; given the repo's ``verified`` ledger and configuration, its
    tensors and configuration must be the ones they bind."""
    decoder = load_text_decoder(path / TEXT_DECODER_FILE, "cpu")
    if verified is not None:
        ledger, config = verified
        check_loaded_tensors(
            ledger, TEXT_DECODER_FILE, path / TEXT_DECODER_FILE, decoder.state_dict()
        )
        check_loaded_decoder_config(config, TEXT_DECODER_FILE, decoder.config.to_dict())
    return decoder.to(device)


@dataclass
class CaptioningModel:
    """A loaded DP-Cap repo that captions: its ``Encoder`` (ledger, transform), the captioner and
    the tokenizer of its vocabulary."""

    encoder: Encoder
    captioner: Captioner
    tokenizer: CaptionTokenizer

    @classmethod
    def from_encoder(cls, encoder: Encoder) -> CaptioningModel:
        """Add the repo's text decoder and vocabulary to a loaded encoder (a verified one's
        must be the files its ledger binds)."""
        path = Path(encoder.path)
        if not encoder.spec.family.captions:
            raise ConfigError(
                f"{encoder.spec.arch} is a {encoder.spec.family.title} encoder: it has no text "
                "decoder"
            )
        missing = [f for f in (TEXT_DECODER_FILE, VOCAB_FILE) if not (path / f).is_file()]
        if missing:
            raise MissingInputError(
                f"{path} has no {' and no '.join(missing)}: it cannot caption "
                "(import it with --vocab, or export it with its text decoder and vocabulary)"
            )
        device = next(encoder.model.parameters()).device
        ledger = encoder.ledger if encoder.verified else None
        decoder = _text_decoder(path, (ledger, encoder.config) if ledger else None, device)
        vocab = path / VOCAB_FILE
        tokenizer = CaptionTokenizer(
            vocab if ledger is None else verified_bytes(ledger, VOCAB_FILE, vocab),
            max_length=decoder.config.max_length,
        )
        decoder.config.check_tokenizer(tokenizer)
        return cls(encoder, Captioner(encoder.model, decoder).eval(), tokenizer)

    @property
    def max_tokens(self) -> int:
        """The most tokens a caption can have."""
        return self.captioner.decoder.config.max_length - 1

    def _batches(
        self, images: Sequence[Image.Image] | torch.Tensor, batch_size: int
    ) -> list[torch.Tensor]:
        device = next(self.captioner.parameters()).device
        out = []
        for start in range(0, len(images), batch_size):
            part = images[start : start + batch_size]
            out.append(
                (part if isinstance(part, torch.Tensor) else self.encoder.preprocess(part)).to(
                    device
                )
            )
        return out

    def caption(
        self,
        images: Sequence[Image.Image] | torch.Tensor,
        max_tokens: int | None = None,
        batch_size: int = 16,
    ) -> list[str]:
        """Greedy captions of PIL images (or a preprocessed batch)."""
        n = self.max_tokens if max_tokens is None else max_tokens
        ids = [
            row
            for batch in self._batches(images, batch_size)
            for row in self.captioner.generate(batch, n)
        ]
        return [self.tokenizer.decode(row) for row in ids]

    def label_texts(self, labels: Sequence[str], prompt: str = DEFAULT_PROMPT) -> torch.Tensor:
        """Token ids (L, T) of ``prompt + " " + label`` for each label (the zero-shot candidates);
        an empty label (no token: blank, control or zero-width characters, lone accents), or one
        too long for the decoder with the prompt, is a ConfigError."""
        if not labels:
            raise ConfigError("zero-shot needs at least one label")
        empty = [i for i, n in enumerate(self.tokenizer.lengths(labels)) if n == 0]
        if empty:
            raise ConfigError(
                f"labels[{empty[0]}] is empty ({labels[empty[0]][:60]!r} has no token)"
            )
        try:
            return self.tokenizer.encode(
                [f"{prompt} {label}".strip() for label in labels], cut=False
            )
        except ConfigError as e:
            raise ConfigError(
                f"labels: with the prompt, {str(e).replace('text ', 'label ', 1)}"
            ) from None

    def zero_shot(
        self,
        images: Sequence[Image.Image] | torch.Tensor,
        labels: Sequence[str],
        prompt: str = DEFAULT_PROMPT,
        batch_size: int = 16,
    ) -> torch.Tensor:
        """Caption loss (N, L) of each label's prompt for each image; the smallest is the
        prediction."""
        texts = self.label_texts(labels, prompt)
        parts = [
            self.captioner.text_losses(b, texts.to(b.device)).cpu()
            for b in self._batches(images, batch_size)
        ]
        return torch.cat(parts) if parts else torch.empty(0, len(labels))


def load_captioner(
    source: str | os.PathLike[str],
    *,
    revision: str | None = None,
    verify: bool = True,
    device: str | torch.device = "cpu",
) -> CaptioningModel:
    """Load a DP-Cap repo (folder or hub id) that carries a text decoder and a vocabulary."""
    return CaptioningModel.from_encoder(
        load_encoder(source, revision=revision, verify=verify, device=device)
    )
