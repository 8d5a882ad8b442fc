"""DP fine-tuning (issue 26's end-to-end row, issue 36's whole-encoder row): a (Syn)-ViP
encoder's top K blocks, or the whole encoder, and a linear head, trained together on labelled
private images with DP-AdamW.

The recipe is a model (the encoder's features in one feature mode, then the linear-probe head
``LinearProbe``, whose normalisation is fixed to public statistics of the init encoder's
features: centred on ``--public-data``, else its procedural images' own, ``head_statistics``), a
per-example loss (cross-entropy over the labels) and ``PerExampleClipper``; everything private
about a step is the DP engine's (``training/dp/engine.py``). Two models:

- ``Classifier`` (``--trainable-blocks K``): the top K blocks, the final norm where the feature
  mode reads it (``avg``, ``cls``), and the head's linear layer; the rest stays the init repo's.
  Images go through the encoder's own transform (the one ``/v1/classify`` applies), without
  augmentation, so what the frozen blocks give for each image is computed once, before training,
  and each step runs the top blocks only.
- ``EncoderClassifier`` (``--trainable-blocks all``, after DP-RandP and De et al. 2022): every
  block the feature mode reads (a spatial mode ``spatial-b<blocks>-g<grid>`` included), the patch
  embedding, the class token (and the final norm for ``avg``/``cls``), and the head; each step runs
  the images through them, with **augmentation multiplicity** (``--augmult K``: K views of each
  example, random shifts by reflection padding and flips from the run's secret stream of (step,
  example); the example's loss is the mean over its views, so its one gradient, the views'
  average, is what is clipped: the sensitivity is the engine's, unchanged).

Either model trains, with ``--encoder-parameters biases``, only the one-dimensional parameters
(biases, normalisation scales) of the encoder part it would train, and the head whole (after Bu et
al. 2022's DP-BiTFiT: the noise then falls on far fewer coordinates). With ``--fixed-head`` (and
``--probe-epsilon``) the DP probe's head is kept as it is and the fine-tuning trains the encoder
part alone.

``--probe-epsilon`` first fits the head as a DP linear probe on the init encoder's frozen
features (``training.recipes.probe.fit_probe``) and starts the fine-tuning from it; the probe's
stage goes into the same ledger (it trained what the fine-tuning started from: component
``encoder``, also the head), and the fine-tuning's noise is calibrated so that the two compose
within ``--epsilon`` (``remaining_epsilon``).

The export is the fine-tuned encoder with the head in its folder under ``HEADS_DIR``. Its
ledger holds the init repo's encoder stages, the probe's stage if any, and one DP stage on the
dataset whose ``also_trains`` names the head (with ``--fixed-head``, the probe's stage alone
does): the encoder's and the head's guarantees are those stages composed.

Run it with ``vip-hub train-finetune ...`` or, on several processes or GPUs,
``torchrun --nproc_per_node N -m training.recipes.finetune ...`` (same arguments).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from PIL import Image
from pydantic import Field, model_validator
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from vip_hub.errors import ConfigError
from vip_hub.loading import Encoder, load_encoder
from vip_hub.models.features import (
    PIXELS,
    SpatialMode,
    check_pooling,
    final_norm,
    pool_features,
    vip_layers,
)
from vip_hub.privacy.accounting import calibrate, remaining_epsilon, resolve_delta
from vip_hub.privacy.ledger import DPStage, PrivacyLedger
from vip_hub.privacy.sensitivity import MIN_CLIP
from vip_hub.repo.heads import HeadInfo, LinearProbe, load_head, save_head
from vip_hub.repo_format import HEAD_FOLDER_SHOWN, WEIGHTS_FILE, head_component, head_file

from ..data.labelled import LabelledArrays, write_image_folder
from ..dp.clipping import BroadcastHook, broadcast
from ..dp.run import DPRun, retrained_if_flagged
from ..dp.sampling import AUGMENT, init_seed, torch_generator
from ..skeleton.checkpoint import load_checkpoint, save_checkpoint
from ..skeleton.config import (
    DPRunConfig,
    EncoderParameters,
    Recipe,
    recipe_main,
    tenth_of_steps,
    with_adamw,
)
from ..skeleton.distributed import Dist
from .probe import (
    PAPER_HEAD_BATCHES,
    PAPER_HEAD_CLIP,
    PAPER_HEAD_LR,
    HeadData,
    LabelledImages,
    ProbeConfig,
    dp_head_sampling,
    dp_head_schedule,
    fit_probe,
    fix_normalisation,
    head_statistics,
    load_head_data,
    load_public_images,
    probe_stage,
    top1_result,
)
from .trainable import encoder_parameters_field, encoder_parameters_note, restrict_encoder

__all__ = [
    "RECIPE",
    "STAGE",
    "ArraysRun",
    "Classifier",
    "EncoderClassifier",
    "FinetuneConfig",
    "arrays_config",
    "augment_views",
    "classifier",
    "evaluate",
    "finetune_arrays",
    "frozen_outputs",
    "train_finetune",
    "trial_finetune",
]

STAGE = "dp-finetune"
"""The name of the DP stage in the exported ledger."""
CURVE_IMAGES = 1000
"""At most this many public test images (every k-th) give the curve's loss at each evaluation
(the final top-1 uses all)."""
FinetunePooling = Literal["avg", "cls", "vip"]
"""The modes ``Classifier`` (top blocks) reads; ``EncoderClassifier`` reads any but ``dpcap`` (the
text decoder's memory) and ``pixels`` (no weight)."""


class FinetuneConfig(
    HeadData,
    # a base made at run time (with_adamw's AdamW fields), which mypy takes as Any
    with_adamw(DPRunConfig, lr=1e-3, warmup=tenth_of_steps, weight_decay=0.05),  # type: ignore[misc]
):
    """A DP fine-tuning run: cross-entropy on labels, DP-AdamW on the top blocks and a head; the
    test folder's loss is also the card's curve."""

    init: str = Field(description="(Syn)-ViP repo folder or hub id whose encoder is fine-tuned")
    head: str = Field("classifier", description=f"head name: the repo gets {HEAD_FOLDER_SHOWN}")
    pooling: str = Field(
        "avg",
        description="feature mode the head reads: avg, cls or vip (the final norm is trained "
        "only where the mode reads it: avg, cls); with --trainable-blocks all also a spatial mode "
        "the init repo declares (spatial-b<blocks>-g<grid>)",
    )
    trainable_blocks: int | Literal["all"] = Field(
        2,
        description="top encoder blocks trained with the head (at most all but the first; the "
        "rest stays the init's), or all: every block the feature mode reads, the patch embedding "
        "and the class token, the images run through them at each step (with --augmult)",
    )
    augmult: int = Field(
        1,
        ge=0,
        description="with --trainable-blocks all: augmented views per example (random shift by "
        "reflection padding, flip), their losses averaged inside the example's gradient before "
        "clipping; 0: the image itself, unaugmented",
    )
    encoder_parameters: EncoderParameters = encoder_parameters_field("the head")
    fixed_head: bool = Field(
        False,
        description="with --probe-epsilon: keep the DP probe's head as it is, the fine-tuning "
        "trains the encoder alone (its noise and its clipping norm then fall on the encoder's "
        "coordinates only)",
    )
    probe_epsilon: float | None = Field(
        None,
        gt=0,
        description="first fit the head as a DP linear probe (DP-SGD) on the init encoder's "
        "frozen features at this epsilon; its stage composes with the fine-tuning's, whose "
        "noise is calibrated so that both stay within --epsilon",
    )
    probe_epochs: int = Field(100, gt=0, description="epochs of the DP probe")
    probe_batch_size: int | None = Field(
        None,
        gt=0,
        description="expected batch of the DP probe "
        f"(default: n / {PAPER_HEAD_BATCHES}, rounded up)",
    )
    probe_lr: float = Field(PAPER_HEAD_LR, gt=0, description="SGD learning rate of the DP probe")
    probe_max_grad_norm: float = Field(
        PAPER_HEAD_CLIP, ge=MIN_CLIP, description="clipping norm of the DP probe"
    )

    @model_validator(mode="after")
    def _fixed_head_has_a_probe(self) -> FinetuneConfig:
        if self.fixed_head and self.probe_epsilon is None:
            raise ValueError("--fixed-head keeps the DP probe's head: give --probe-epsilon")
        return self

    def probe_config(self, n: int) -> ProbeConfig:
        """The DP probe's settings on ``n`` records (SGD, momentum 0.9, warm-up + cosine)."""
        return ProbeConfig(
            encoder=self.init,
            data=self.data,
            dataset_name=self.dataset_name,
            head=self.head,
            pooling=self.pooling,
            **dp_head_schedule(n, self.probe_epochs, batch_size=self.probe_batch_size),
            lr=self.probe_lr,
            epsilon=self.probe_epsilon,
            delta=resolve_delta(self.delta, n),
            max_grad_norm=self.probe_max_grad_norm,
            accountant=self.accountant,
            allow_weak_delta=self.allow_weak_delta,
            public_data=self.public_data,
        )


class Classifier(nn.Module):
    """An encoder's ``pooling`` features, then a linear-probe head whose normalisation is fixed
    (eval mode whatever ``train`` says). The blocks below the top ``trained`` ones are frozen, so
    what they compute is a fixed function of each image, computed once (``frozen``); training runs
    the top blocks on it: ``forward(tokens, means, labels)`` gives per-example cross-entropies,
    each depending on its own example only, and ``logits(images)`` is the served computation."""

    def __init__(
        self, encoder: VisionTransformer, head: LinearProbe, pooling: FinetunePooling, trained: int
    ):
        super().__init__()
        self.encoder, self.head, self.pooling = encoder, head, pooling
        depth = len(encoder.blocks)
        self.first = depth - trained  # the first trained block
        lowest_read = depth - vip_layers(encoder) if pooling == "vip" else depth
        self.read = list(range(lowest_read, self.first))  # frozen outputs the vip mode reads
        self.indices = self.read or [self.first - 1]  # the last one's output enters the top

    def train(self, mode: bool = True) -> Classifier:
        """Set the encoder's mode; the head's normalisation stays fixed."""
        super().train(mode)
        self.head.norm.eval()
        return self

    @torch.no_grad()
    def frozen(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What the frozen blocks give for a preprocessed batch: the tokens entering the first
        trained block (b, tokens, width), and the patch-token means of the frozen blocks the
        feature mode reads (b, m, width; m = 0 but for ``vip`` with fewer than 6 trained)."""
        # intermediates_only with return_prefix_tokens: a list of (patch tokens, prefix tokens)
        outputs = cast(
            list[tuple[torch.Tensor, torch.Tensor]],
            self.encoder.forward_intermediates(
                images,
                indices=self.indices,
                norm=False,
                output_fmt="NLC",
                return_prefix_tokens=True,
                intermediates_only=True,
                stop_early=True,
            ),
        )
        spatial, prefix = outputs[-1]
        means = [s.mean(dim=1) for s, _ in outputs[: len(self.read)]]
        width = spatial.shape[-1]
        stacked = torch.stack(means, 1) if means else spatial.new_zeros(len(spatial), 0, width)
        return torch.cat([prefix, spatial], dim=1), stacked

    def top(self, tokens: torch.Tensor, means: torch.Tensor) -> torch.Tensor:
        """Class scores from what ``frozen`` gave: the trained blocks, the pooling, the head."""
        p = self.encoder.num_prefix_tokens
        outputs = [(means[:, i : i + 1], means[:, :0]) for i in range(means.shape[1])]
        x = tokens
        for block in self.encoder.blocks[self.first :]:
            x = block(x)
            outputs.append((x[:, p:], x[:, :p]))
        features = pool_features(self.encoder, outputs, (self.pooling,))[self.pooling]
        return self.head(features)

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        """Class scores of a preprocessed batch, (b, classes)."""
        return self.top(*self.frozen(images))

    def forward(
        self, tokens: torch.Tensor, means: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        return F.cross_entropy(self.top(tokens, means), labels, reduction="none")


class EncoderClassifier(nn.Module):
    """The whole encoder as far as ``pooling`` reads (the patch embedding, the class token, the
    blocks up to the deepest one the mode reads), then the head, whose normalisation is fixed.
    ``forward(views, labels)`` takes K views per example (b, K, 3, H, W) and gives each example's
    cross-entropy averaged over its views (b,): the layers run on the b K views, and the clipper
    sums each example's K rows into its one gradient (``PerExampleClipper``). The class token is
    broadcast over the batch here, announced through ``broadcast_hooks``."""

    def __init__(self, encoder: VisionTransformer, head: LinearProbe, pooling: str):
        super().__init__()
        self.encoder, self.head, self.pooling = encoder, head, pooling
        spatial, depth = check_pooling(pooling, encoder), len(encoder.blocks)
        if spatial is not None:
            self.indices = [b - 1 for b in spatial.blocks]
        elif pooling == "vip":
            self.indices = list(range(depth - vip_layers(encoder), depth))
        else:
            self.indices = [depth - 1]
        self.broadcast_hooks: list[BroadcastHook] = []

    def train(self, mode: bool = True) -> EncoderClassifier:
        """Set the encoder's mode; the head's normalisation stays fixed."""
        super().train(mode)
        self.head.norm.eval()
        return self

    def broadcast_parameters(self) -> list[nn.Parameter]:
        """The class token, when trained (see ``broadcast_hooks``)."""
        token = self.encoder.cls_token
        return [token] if token is not None and token.requires_grad else []

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """The ``pooling`` features of a preprocessed batch: timm's own forward, with the class
        token broadcast here."""
        enc = self.encoder
        x = enc.patch_embed(images)
        if enc.cls_token is not None:
            token = broadcast(enc.cls_token, (len(x), -1, -1), self.broadcast_hooks)
            x = torch.cat([token, x], dim=1)
        x = enc.norm_pre(enc.patch_drop(enc.pos_drop(x + enc.pos_embed)))
        p, outputs = enc.num_prefix_tokens, []
        for i, block in enumerate(enc.blocks[: self.indices[-1] + 1]):
            x = block(x)
            if i in self.indices:
                outputs.append((x[:, p:], x[:, :p]))
        return pool_features(enc, outputs, (self.pooling,), blocks=self.indices)[self.pooling]

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        """Class scores of a preprocessed batch, (b, classes)."""
        return self.head(self.features(images))

    def forward(self, views: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, k = views.shape[:2]
        logits = self.logits(views.flatten(0, 1))
        losses = F.cross_entropy(logits, labels.repeat_interleave(k), reduction="none")
        return losses.view(b, k).mean(1)


def augment_views(image: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` views (count, 3, H, W) of a preprocessed image: each shifted by up to H/8 pixels
    (reflection padding, then a crop) and flipped left-right with probability 1/2, drawn from
    ``generator``; ``count`` 0 gives the image itself as one view."""
    if count == 0:
        return image[None]
    h, w = image.shape[-2:]
    pad = max(1, h // 8)
    padded = F.pad(image[None], (pad, pad, pad, pad), mode="reflect")[0]
    shifts = torch.randint(0, 2 * pad + 1, (count, 2), generator=generator).tolist()
    flips = (torch.rand(count, generator=generator) < 0.5).tolist()
    views = [padded[:, dy : dy + h, dx : dx + w] for dy, dx in shifts]
    return torch.stack([v.flip(-1) if f else v for v, f in zip(views, flips, strict=True)])


def classifier(
    init: Encoder,
    num_classes: int,
    pooling: str,
    trainable_blocks: int | Literal["all"],
    head: LinearProbe | None = None,
    domain: Sequence[Image.Image] | None = None,
    parameters: EncoderParameters = "all",
    train_head: bool = True,
) -> Classifier | EncoderClassifier:
    """``init``'s encoder with its top ``trainable_blocks`` blocks (and its final norm, where
    ``pooling`` reads it) trainable, or (``"all"``) everything ``pooling`` reads, of them their
    one-dimensional parameters alone with ``parameters`` ``biases``; and ``head`` (a DP probe's;
    trained unless ``train_head`` is False) or a fresh head normalised by public features
    (``head_statistics``: centred on the PUBLIC ``domain`` images' features when given)."""
    encoder, depth = init.model, len(init.model.blocks)
    init.check_pooling(pooling)
    spatial = SpatialMode.parse(pooling)
    if trainable_blocks != "all":
        if trainable_blocks < 1 or trainable_blocks >= depth:
            raise ConfigError(
                f"--trainable-blocks {trainable_blocks}: the {init.spec.arch} encoder has "
                f"{depth} blocks, of which 1 to {depth - 1} can be trained (the first stays "
                "frozen), or all"
            )
        if pooling not in ("avg", "cls", "vip"):
            raise ConfigError(
                f"--pooling {pooling}: the top-blocks model reads avg, cls or vip; "
                "train a spatial mode with --trainable-blocks all"
            )
    elif pooling in ("dpcap", PIXELS):
        raise ConfigError(
            f"--pooling {pooling}: the whole-encoder model reads the encoder's own modes"
        )
    if head is None:
        if not train_head:
            raise ConfigError("a fixed head is a DP probe's: give the probe's head")
        head = LinearProbe(init.feature_dim(pooling), num_classes)
        fix_normalisation(head, head_statistics(init, pooling, domain))
    encoder.requires_grad_(False)
    reads_norm = spatial is None and pooling != "vip"  # the spatial and vip modes skip it
    if trainable_blocks == "all":
        model: Classifier | EncoderClassifier = EncoderClassifier(encoder, head, pooling)
        trained = [encoder.patch_embed, *encoder.blocks[: model.indices[-1] + 1]]
        token = encoder.cls_token  # trained unless the family fixes it (DP-Cap's random one)
        if token is not None and not init.spec.family.frozen_tokens:
            token.requires_grad_(True)
    else:
        # pooling: avg, cls or vip (checked above)
        model = Classifier(encoder, head, cast(FinetunePooling, pooling), trainable_blocks)
        trained = list(encoder.blocks[depth - trainable_blocks :])
    if reads_norm:
        trained.append(final_norm(encoder))
    for module in trained:
        module.requires_grad_(True)
    restrict_encoder(encoder, parameters)
    head.linear.requires_grad_(train_head)
    return model.train()


def _preprocessed(
    transform: Callable[[Image.Image], torch.Tensor],
    images: Sequence[Image.Image],
    batch: int = 256,
) -> Iterator[torch.Tensor]:
    """``images`` through ``transform``, ``batch`` at a time."""
    for start in range(0, len(images), batch):
        yield torch.stack([transform(i.convert("RGB")) for i in images[start : start + batch]])


def frozen_outputs(
    model: Classifier,
    transform: Callable[[Image.Image], torch.Tensor],
    images: Sequence[Image.Image],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``model.frozen`` of every image, on the CPU: computed once, before training (the frozen
    blocks never change and there is no augmentation)."""
    parts = [model.frozen(x.to(device)) for x in _preprocessed(transform, images)]
    return torch.cat([t.cpu() for t, _ in parts]), torch.cat([m.cpu() for _, m in parts])


@torch.no_grad()
def evaluate(
    model: Classifier | EncoderClassifier,
    transform: Callable[[Image.Image], torch.Tensor],
    images: Sequence[Image.Image],
    labels: Sequence[int],
    device: torch.device,
) -> tuple[float, float]:
    """Mean cross-entropy and top-1 on labelled (public) images, in eval mode."""
    was = model.training
    model.eval()
    loss, right, start = 0.0, 0, 0
    for x in _preprocessed(transform, images):
        y = torch.as_tensor(labels[start : start + len(x)], device=device)
        logits = model.logits(x.to(device)).float()
        loss += F.cross_entropy(logits, y, reduction="sum").item()
        right += int((logits.argmax(1) == y).sum())
        start += len(x)
    model.train(was)
    return loss / max(len(images), 1), right / max(len(images), 1)


def _probe_plan(cfg: FinetuneConfig, n: int) -> tuple[float, float, int] | None:
    """The DP probe's (sigma, q, steps) on ``n`` records (known before it runs), or None."""
    if cfg.probe_epsilon is None:
        return None
    probe = cfg.probe_config(n)
    q, steps = dp_head_sampling(n, probe)
    assert probe.epsilon is not None and probe.delta is not None  # probe_config sets both
    return calibrate(probe.epsilon, probe.delta, q, steps, probe.accountant), q, steps


def _with_probe(cfg: FinetuneConfig, n: int) -> FinetuneConfig:
    """``cfg`` with the fine-tuning's own epsilon: what is left of ``--epsilon`` after the DP
    probe (``remaining_epsilon``: the two compose within it), or ``cfg`` without a probe."""
    plan = _probe_plan(cfg, n)
    if plan is None or cfg.epsilon is None:
        return cfg
    q = cfg.batch_size / n
    delta = resolve_delta(cfg.delta, n)
    own = remaining_epsilon(cfg.epsilon, delta, [plan], q, cfg.steps, cfg.accountant)
    return cfg.model_copy(update={"epsilon": own})


def _probe(
    cfg: FinetuneConfig,
    init: Encoder,
    train: LabelledImages,
    run: DPRun,
    domain: Sequence[Image.Image] | None,
) -> tuple[LinearProbe, DPStage] | None:
    """The DP probe's head and its ledger stage: fitted on ``init``'s frozen ``cfg.pooling``
    features (noise and sampling from a fresh secret, ``fit_probe``; centred on the PUBLIC
    ``domain`` images when given), or read back from the run
    folder when the run resumes (the released model depends on the one probe that ran)."""
    if cfg.probe_epsilon is None:
        return None
    saved = run.dir / "probe.pt"
    if saved.exists():
        # the probe drew its own secret: it binds the run's settings, not its seed (a fresh
        # start after a kill before the first checkpoint draws a new one and keeps the probe)
        blob = load_checkpoint(saved, run.unseeded_settings(), run.cfg.run_defaults())
        head = LinearProbe(*blob["shape"])
        head.load_state_dict(blob["head"])
        return head.eval(), DPStage.model_validate_json(blob["stage"])
    n, probe = len(train.labels), cfg.probe_config(len(train.labels))
    x = init.embed(train.images, cfg.pooling)
    head, dp = fit_probe(
        x,
        torch.as_tensor(train.labels),
        len(train.classes),
        probe,
        head_statistics(init, cfg.pooling, domain),
        desc="DP probe",
    )
    if (dp["sigma"], dp["sample_rate"], dp["steps"]) != _probe_plan(cfg, n):
        raise RuntimeError(f"the probe ran {dp}, not the plan the fine-tuning was calibrated to")
    stage = probe_stage(probe, train.dataset, dp, fine_tuned=True)
    assert isinstance(stage, DPStage)  # the probe ran with DP (dp is not empty)
    shape = (head.linear.in_features, head.linear.out_features)
    save_checkpoint(
        saved,
        {
            "config": run.unseeded_settings(),
            "head": head.state_dict(),
            "shape": shape,
            "stage": stage.model_dump_json(),
        },
    )
    return head, stage


@dataclass
class _Fitted:
    """A fine-tuning run after its training, before anything is exported."""

    run: DPRun
    init: Encoder
    model: Classifier | EncoderClassifier
    train: LabelledImages
    test: LabelledImages | None
    probe: tuple[LinearProbe, DPStage] | None
    records: list[dict[str, Any]]
    trained: int
    device: torch.device

    def top1(self) -> float | None:
        """Top-1 on the public test folder (all of it), or None without one."""
        if self.test is None:
            return None
        _, top1 = evaluate(
            self.model,
            self.init.transform,
            self.test.images,
            self.test.labels.tolist(),
            self.device,
        )
        return top1


def _fit(cfg: FinetuneConfig, dist: Dist | None) -> _Fitted:
    """Run (or resume) the DP probe (with ``--probe-epsilon``) and the DP fine-tuning."""
    dist = dist or Dist.from_env(cfg.device)
    head_component(cfg.head)  # the name is checked before any work
    whole = cfg.trainable_blocks == "all"
    if cfg.augmult != 1 and not whole:
        raise ConfigError(
            "--augmult needs --trainable-blocks all (the top-blocks model reads "
            "the frozen blocks' outputs of unaugmented images)"
        )
    train, test = load_head_data(cfg, cfg.dataset_name, dp=True)  # always a DP head
    n = len(train.labels)
    run = DPRun(_with_probe(cfg, n), dist, n)
    init = load_encoder(cfg.init)
    run.from_init(init)
    init.check_pooling(cfg.pooling)
    domain = load_public_images(cfg.public_data) if cfg.public_data else None  # read once
    probe = _probe(cfg, init, train, run, domain)
    torch.manual_seed(init_seed(run.seed))  # the fresh head, the same on every rank
    model = classifier(
        init,
        len(train.classes),
        cfg.pooling,
        cfg.trainable_blocks,
        head=probe[0] if probe is not None else None,
        domain=domain,
        parameters=cfg.encoder_parameters,
        train_head=not cfg.fixed_head,
    )
    model.to(dist.device)
    engine = run.engine(model)
    labels = torch.as_tensor(train.labels)

    if isinstance(model, EncoderClassifier):
        pixels = torch.cat(list(_preprocessed(init.transform, train.images)))

        def load(index: int, step: int) -> tuple[torch.Tensor, ...]:
            views = augment_views(
                pixels[index], cfg.augmult, torch_generator(run.seed, AUGMENT, step, index)
            )
            return views, labels[index]

    else:
        tokens, means = frozen_outputs(model, init.transform, train.images, dist.device)

        def load(index: int, step: int) -> tuple[torch.Tensor, ...]:
            return tokens[index], means[index], labels[index]

    def curve() -> dict[str, float]:
        if test is None:
            return {}
        every = -(-len(test.labels) // CURVE_IMAGES)  # evenly spread: the folder is by class
        loss, top1 = evaluate(
            model,
            init.transform,
            test.images[::every],
            test.labels[::every].tolist(),
            dist.device,
        )
        return {"public_loss": loss, "public_top1": top1}

    records = engine.train(run, model, load, desc="train-finetune", evaluate=curve)
    trained = sum(p.numel() for p in engine.params)
    return _Fitted(run, init, model, train, test, probe, records, trained, dist.device)


def train_finetune(cfg: FinetuneConfig, dist: Dist | None = None) -> Path:
    """Run (or resume) DP fine-tuning (after a DP probe, with ``--probe-epsilon``) and export the
    released encoder with its head; returns the repo's path."""
    f = _fit(cfg, dist)
    model, run, init, probe, train = f.model, f.run, f.init, f.probe, f.train
    n, spec, component = len(train.labels), init.spec, head_component(cfg.head)
    depth, k, trained = len(model.encoder.blocks), cfg.trainable_blocks, f.trained
    reads_norm = cfg.pooling in ("avg", "cls")
    norm = " and the final norm" if reads_norm else ""
    only = encoder_parameters_note(cfg.encoder_parameters)
    if isinstance(model, EncoderClassifier):
        token = ", the class token" if model.broadcast_parameters() else ""
        what = (
            f"the whole encoder the {cfg.pooling} features read (the patch embedding{token}, "
            f"blocks 1-{model.indices[-1] + 1} of {depth}{norm}{only})"
        )
        augmentation = (
            f"{cfg.augmult} views per example (shift by up to 1/8 of the side, reflection "
            "padding; flip), their losses averaged inside the example's gradient before clipping"
            if cfg.augmult
            else "none (the encoder's own transform)"
        )
    else:
        what, augmentation = (
            f"the top {k} of {depth} blocks{norm}{only}",
            "none (the encoder's own transform)",
        )
    normalised = (
        "public images of the task's domain (--public-data), centred on their mean"
        if cfg.public_data
        else "public procedural images"
    )
    stage = probe[1] if probe is not None else None
    start = (
        f"the head {cfg.head} of a DP linear probe ({stage.name}, in this ledger)"
        if stage is not None
        else "a fresh head"
    )
    trains = what + (  # a fixed head is the probe's, released as the probe left it
        f", under the probe's linear head {component}, fixed (--fixed-head)"
        if cfg.fixed_head
        else f" and the linear head {component}"
    )
    out = run.export_dp(
        model.encoder,
        spec,
        init,
        released={WEIGHTS_FILE: model.encoder, head_file(cfg.head): model.head},
        records=f.records,
        curve_label="cross-entropy on public test images"
        if f.test is not None
        else "no public labelled data: no loss curve",
        dataset_description=f"{n} labelled images, {len(train.classes)} classes; DP fine-tuning",
        summary=(
            f"A {spec.arch} encoder fine-tuned with DP-AdamW on {cfg.dataset_name} "
            f"({n} labelled images), starting from {cfg.init} and {start}: {trains} "
            f"({cfg.pooling} features), trained by one DP stage; the guarantee of both composes "
            "the probe's stage (where there is one) and this one."
        ),
        name=STAGE,
        also_trains=[] if cfg.fixed_head else [component],
        earlier=[stage] if stage is not None else [],
        description=(
            f"DP fine-tuning: cross-entropy over {len(train.classes)} classes; DP-AdamW with "
            f"per-example clipping to C = {cfg.max_grad_norm:g}, Gaussian noise sigma x the "
            "sensitivity (C times its rounding allowance) once per logical step, "
            f"Poisson sampling. Trained from {start}: {trains} ({trained:,} parameters); the "
            "rest of the encoder is the init repo's, unchanged. The head's normalisation is "
            f"fixed to the init encoder's features of {normalised}. Augmentation: {augmentation}"
        ),
        hyperparameters={
            **cfg.adamw_hyperparameters(),
            "img_size": spec.img_size,
            "pooling": cfg.pooling,
            "trainable_blocks": k,
            "encoder_parameters": cfg.encoder_parameters,
            "encoder_trainable_parameters": sum(
                p.numel() for p in model.encoder.parameters() if p.requires_grad
            ),
            "trainable_parameters": trained,
            "augmult": cfg.augmult if isinstance(model, EncoderClassifier) else None,
            "augmentation": augmentation,
            "probe_epsilon": cfg.probe_epsilon,
            "fixed_head": cfg.fixed_head,
        },
    )
    metrics: dict[str, object] = {"train_size": n, "fine_tuned_blocks": k}
    result, top1 = None, f.top1()
    if f.test is not None and top1 is not None:
        metrics |= {"top1": top1, "test_data": "public", "test_size": len(f.test.labels)}
        result = top1_result(
            cfg.test_data, top1, f"top-1, DP fine-tuned head '{cfg.head}' ({cfg.pooling} features)"
        )
    info = HeadInfo(cfg.head, cfg.pooling, train.classes, metrics)
    return run.export(lambda key: save_head(out, model.head, info, None, result, key))


@dataclass(frozen=True)
class ArraysRun:
    """What ``finetune_arrays`` measured: the released repo, its fine-tuning stage and every DP
    stage the classifier rests on (the DP probe's, then the fine-tuning's), the head's top-1 on
    the public test arrays and the recipe's wall time (data written to folders excluded)."""

    repo: Path
    stage: DPStage
    stages: list[DPStage]
    top1: float
    seconds: float


def trial_finetune(cfg: FinetuneConfig, dist: Dist | None = None) -> float:
    """Train as ``train_finetune`` does and return top-1 on ``--test-data``, exporting nothing:
    a setting's trial on public records standing in for private ones (``benchmarks/standin.py``),
    whose epsilon means nothing and whose guarantee may be none (delta up to 1)."""
    if cfg.test_data is None:
        raise ConfigError("a trial scores on --test-data: give it")
    top1 = _fit(cfg, dist).top1()
    assert top1 is not None  # test_data is set
    return top1


def arrays_config(
    init: str | os.PathLike[str],
    train: LabelledArrays,
    test: LabelledArrays,
    work: Path,
    public: LabelledArrays | None,
    epsilon: float,
    delta: float,
    settings: dict[str, Any],
) -> FinetuneConfig:
    """A run on arrays (``finetune_arrays``'s, or one for ``trial_finetune``): ``train`` and
    ``test`` (and ``public``) written as class folders under ``work``, the repo to
    ``work/finetuned``; ``settings``: other ``FinetuneConfig`` fields."""
    # the run's fields (out, epsilon, ...) come from with_adamw's base, which mypy does not see
    return FinetuneConfig(  # type: ignore[call-arg]
        init=str(init),
        data=str(write_image_folder(train, work / "train", train.classes)),
        test_data=str(write_image_folder(test, work / "test", test.classes)),
        public_data=(
            None
            if public is None
            else str(write_image_folder(public, work / "public", public.classes))
        ),
        out=str(work / "finetuned"),
        dataset_name=train.dataset.name,
        epsilon=epsilon,
        delta=delta,
        **{"restart": True, **settings},
    )


def finetune_arrays(
    init: str | os.PathLike[str],
    train: LabelledArrays,
    test: LabelledArrays,
    work: str | os.PathLike[str],
    *,
    public: LabelledArrays | None = None,
    epsilon: float,
    delta: float,
    **settings: Any,
) -> ArraysRun:
    """Fine-tune ``init`` on ``train`` (private, under its dataset's declared name) at
    (``epsilon``, ``delta``) and measure top-1 on ``test`` (public): both written as class folders
    under ``work`` (and ``public``, PUBLIC records that centre the heads, ``--public-data``), the
    repo to ``work/finetuned``; ``settings``: other ``FinetuneConfig`` fields (a run starts over
    unless ``restart=False``); a run its audit flags is trained once more from a fresh secret
    (``retrained_if_flagged``)."""
    cfg = arrays_config(init, train, test, Path(work), public, epsilon, delta, settings)
    start = time.perf_counter()
    repo = retrained_if_flagged(train_finetune, cfg)
    seconds = time.perf_counter() - start
    stages = PrivacyLedger.read(repo).dp_stages()
    stage = next(s for s in stages if s.name == STAGE)
    top1 = float(load_head(repo, cfg.head)[1].metrics["top1"])
    return ArraysRun(repo, stage, stages, top1, seconds)


RECIPE = Recipe(FinetuneConfig, train_finetune)

if __name__ == "__main__":
    raise SystemExit(recipe_main("train-finetune"))
