"""The DP-Cap recipe: an image captioner (a DP-Cap encoder + the reference text decoder) trained
with DP-AdamW on private image-caption pairs (Sander et al., 2024).

The recipe is a model (``vip_hub.models.text_decoder.Captioner``), a per-example loss (the
reference's caption loss) and a clipper (``PerExampleClipper`` over every trainable parameter,
the token embedding included); everything private about a step is the DP engine's
(``training/dp/engine.py``), as in the ViP recipe (``training/recipes/vip.py``). The encoder starts
from a synthetic-image MAE of the DP-Cap family (``vip-hub train-syn --arch dpcap-*``), the text
decoder from scratch. The tokenizer's vocabulary is a public file fixed before training, never
fitted on the private captions. Augmentations are drawn per example from the (seed, step, index)
streams.

Run it with ``vip-hub train-dpcap ...`` or ``torchrun --nproc_per_node N -m training.recipes.dpcap
...``.

Captions over class names, their vocabulary and public captions are data preparation:
``training/data/labelled.py`` (``write_caption_folder``, ``class_vocabulary``,
``class_public_captions``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import Field

from vip_hub.errors import ConfigError, DataError, MissingInputError
from vip_hub.loading import load_encoder
from vip_hub.models.text_decoder import Captioner, TextDecoder, TextDecoderConfig
from vip_hub.models.tokenizer import MAX_LENGTH, CaptionTokenizer
from vip_hub.privacy.sensitivity import MIN_CLIP
from vip_hub.repo.card import recipe_line
from vip_hub.repo_format import TEXT_DECODER_FILE, VOCAB_FILE, WEIGHTS_FILE

from ..data.images import (
    CAPTIONS_FILE,
    MAE_AUGMENTATION,
    Augmented,
    mae_transform,
    open_captions,
)
from ..dp.run import DPRun
from ..dp.sampling import init_seed
from ..skeleton.config import DPRunConfig, Recipe, recipe_main, two_fifths_of_steps, with_adamw
from ..skeleton.distributed import Dist
from .mae import (
    decoder_warmup_field,
    eval_loss,
    freeze_fixed_tokens,
    public_images,
    warm_fresh_decoder,
)
from .trainable import (
    EncoderParameters,
    encoder_parameters_field,
    encoder_parameters_note,
    restrict_encoder,
)

__all__ = ["PUBLIC_CAPTIONS", "RECIPE", "DPCapConfig", "public_caption_loss", "train_dpcap"]

PUBLIC_CAPTIONS = (
    "an abstract pattern of colours",
    "a colourful texture",
    "a picture of circles and squares",
    "a pattern of cells",
    "waves and spirals",
    "a kaleidoscope pattern",
    "a cloudy swirl of colour",
    "a blurry abstract picture",
)
"""Default captions of the public curve's procedural images (image i gets caption i mod 8)."""


class DPCapConfig(
    # a base made at run time (with_adamw's AdamW fields), which mypy takes as Any
    with_adamw(DPRunConfig, lr=5.12e-4, warmup=two_fifths_of_steps, weight_decay=0.05)  # type: ignore[misc]
):
    """A DP-Cap run: DP-AdamW on the caption loss. Defaults follow the DP-Cap paper (C = 1, AdamW
    (0.9, 0.95), weight decay 0.05, lr 5.12e-4, 40 % warm-up, cosine over twice the run), with a
    small text decoder for the CPU (the reference's is 6 blocks of up to 768)."""

    init: str = Field(
        description="DP-Cap repo folder or hub id to start from, e.g. the output of "
        "`vip-hub train-syn --arch dpcap-nano`"
    )
    data: str = Field(
        description="image-caption pairs: webdataset tar shards (KEY.jpg/KEY.png + KEY.txt) or a "
        f"folder with a {CAPTIONS_FILE}"
    )
    vocab: str = Field(
        description=f"public vocabulary file (BERT-style {VOCAB_FILE}, e.g. bert-base-uncased's), "
        "fixed before training and never fitted on the private captions"
    )
    max_grad_norm: float = Field(1.0, ge=MIN_CLIP, description="clipping norm C (the paper's 1)")
    decay_steps: int | None = Field(
        None, gt=0, description="cosine decay horizon (default: twice the steps)"
    )
    decoder_width: int = Field(
        128, gt=0, description="text decoder width (reference: the encoder's, up to 768)"
    )
    decoder_depth: int = Field(2, gt=0, description="text decoder blocks (reference: 6)")
    decoder_heads: int = Field(4, gt=0, description="text decoder attention heads")
    max_length: int = Field(
        MAX_LENGTH,
        ge=2,
        le=512,
        description="caption tokens, [CLS] and [SEP] included (longer captions are cut)",
    )
    public_captions: str | None = Field(
        None,
        description="file of public captions (one a line) scored on fixed "
        "procedural images for the card's curve (default: "
        "built-in descriptions of such images)",
    )
    decoder_warmup: int = decoder_warmup_field("text decoder")
    encoder_parameters: EncoderParameters = encoder_parameters_field()


def train_dpcap(cfg: DPCapConfig, dist: Dist | None = None) -> Path:
    """Run (or resume) DP-AdamW training of a captioner and export the released repo; returns
    its path."""
    dist = dist or Dist.from_env(cfg.device)
    vocab, tokenizer = _vocabulary(cfg)
    public = _public_captions(cfg.public_captions)
    init = load_encoder(cfg.init)
    spec = init.spec
    if not spec.family.captions:
        raise ConfigError(
            f"{cfg.init} holds a {spec.family.title} encoder ({spec.arch}); DP-Cap trains a "
            "DP-Cap encoder (no qkv bias, final norm on every token, frozen class token). Make "
            "one with `vip-hub train-syn --arch dpcap-nano --out DIR` (any dpcap-* size) and "
            "pass --init DIR"
        )
    pairs = open_captions(cfg.data)
    n = len(pairs)
    run = DPRun(cfg, dist, n)
    run.from_init(init)
    torch.manual_seed(
        init_seed(run.seed)
    )  # the fresh decoder's initialisation, the same on every rank
    decoder = TextDecoder(
        TextDecoderConfig.for_encoder(
            spec,
            tokenizer,
            width=cfg.decoder_width,
            depth=cfg.decoder_depth,
            num_heads=cfg.decoder_heads,
        )
    )
    model = Captioner(freeze_fixed_tokens(init.model.train(), spec), decoder).to(dist.device)
    transform = mae_transform(init.model, spec.img_size)
    warm_fresh_decoder(
        run,
        model,
        model.encoder,
        transform,
        public_caption_loss(model, tokenizer, public),
        cfg.decoder_warmup,
        "text decoder",
    )
    horizon = cfg.decay_steps or 2 * cfg.steps
    trained = restrict_encoder(model.encoder, cfg.encoder_parameters)
    engine = run.engine(model, horizon=horizon)  # after the warm-up: its average starts there
    augmented = Augmented(pairs, transform, run.seed)

    def load(index: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = tokenizer.encode([pairs.caption(index)])[0]
        return augmented[index, step], F.pad(
            ids, (0, cfg.max_length - len(ids)), value=tokenizer.pad_id
        )

    eval_images = public_images(spec)
    eval_texts = tokenizer.encode([public[i % len(public)] for i in range(len(eval_images))])
    records = engine.train(
        run,
        model,
        load,
        desc="train-dpcap",
        prepare=lambda micro: _trimmed(micro, tokenizer.pad_id),
        evaluate=lambda: {"public_loss": eval_loss(model, (eval_images, eval_texts), dist.device)},
    )

    return run.export_dp(
        model.encoder,
        spec,
        init,
        released={WEIGHTS_FILE: model.encoder, TEXT_DECODER_FILE: model.decoder},
        records=records,
        curve_label="caption loss on public procedural images",
        dataset_description=f"{n} image-caption pairs; image captioning with DP-AdamW",
        summary=(
            f"A {spec.arch} image captioner trained with the DP-Cap recipe: from {cfg.init}, "
            f"made by {recipe_line(init.ledger)}, then DP-AdamW captioning on "
            f"{cfg.dataset_name} ({n} image-caption pairs). The loss curve is measured on public "
            "procedural images with public captions, so publishing it costs no privacy."
        ),
        files={"text_decoder": model.decoder, "vocab": vocab},
        name="dp-captioning",
        description=(
            "DP-Cap: image captioning with DP-AdamW (per-example clipping of every trained "
            "parameter, token embedding included; Gaussian noise once per logical step, "
            "Poisson sampling); the text decoder is trained from scratch in this stage"
            + (
                f", its first {cfg.decoder_warmup} steps on public procedural images with the "
                "public captions, the encoder frozen (no private data)"
                if cfg.decoder_warmup
                else ""
            )
            + encoder_parameters_note(cfg.encoder_parameters)
        ),
        hyperparameters={
            **cfg.adamw_hyperparameters(
                "linear warm-up, then half-cycle cosine reaching 0 at decay_steps",
                decay_steps=horizon,
            ),
            "img_size": spec.img_size,
            "text_decoder": {
                "width": cfg.decoder_width,
                "depth": cfg.decoder_depth,
                "heads": cfg.decoder_heads,
            },
            "max_length": cfg.max_length,
            "vocab_size": tokenizer.vocab_size,
            "vocabulary": (
                f"public file fixed before training ({VOCAB_FILE}), not fitted on the captions"
            ),
            "augmentation": MAE_AUGMENTATION,
            "decoder_warmup": cfg.decoder_warmup,
            "encoder_parameters": cfg.encoder_parameters,
            "encoder_trainable_parameters": trained,
        },
    )


def public_caption_loss(
    model: Captioner, tokenizer: CaptionTokenizer, captions: Sequence[str]
) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """``warm_decoder``'s loss for ``model``: its mean caption loss, public image ``first + i``
    captioned by ``captions[(first + i) % len(captions)]``."""

    def loss(images: torch.Tensor, first: int) -> torch.Tensor:
        texts = [captions[(first + i) % len(captions)] for i in range(len(images))]
        return model(images, tokenizer.encode(texts).to(images.device)).mean()

    return loss


def _vocabulary(cfg: DPCapConfig) -> tuple[bytes, CaptionTokenizer]:
    """The public vocabulary file's bytes and its tokenizer."""
    path = Path(cfg.vocab)
    if not path.is_file():
        raise MissingInputError(f"--vocab {path} is not a file (a public BERT-style {VOCAB_FILE})")
    vocab = path.read_bytes()
    try:
        return vocab, CaptionTokenizer(vocab, max_length=cfg.max_length)
    except ConfigError as e:
        raise ConfigError(f"--vocab {path}: {e}") from None


def _public_captions(path: str | None) -> Sequence[str]:
    """The public curve's captions: the lines of ``path`` (blank ones skipped), or
    ``PUBLIC_CAPTIONS``."""
    if path is None:
        return PUBLIC_CAPTIONS
    try:
        lines = [
            line.strip()
            for line in Path(path).read_text(encoding="utf-8").splitlines()
            if line.strip()
        ]
    except FileNotFoundError:
        raise MissingInputError(f"--public-captions {path} is not a file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"--public-captions {path}: {e}") from None
    if not lines:
        raise DataError(f"--public-captions {path} holds no caption")
    return lines


def _trimmed(
    micro: Iterable[tuple[torch.Tensor, ...]], pad_id: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Micro-batches with the trailing text columns that are padding in every row cut off: the
    loss and the gradients are those of the full width (padding is ignored, attention is
    causal), at less cost."""
    for images, text in micro:
        yield images, text[:, : int((text != pad_id).any(0).nonzero().max()) + 1]


RECIPE = Recipe(DPCapConfig, train_dpcap)

if __name__ == "__main__":
    raise SystemExit(recipe_main("train-dpcap"))
