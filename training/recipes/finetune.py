"""DP fine-tuning (issue 26's end-to-end row): a (Syn)-ViP encoder's top K blocks and a new
linear head, trained together on labelled private images with DP-AdamW.

The recipe is a model (``Classifier``: the encoder's features in one feature mode, then the
linear-probe head ``LinearProbe``, whose normalisation is fixed to the init encoder's features of
public procedural images), a per-example loss (cross-entropy over the labels) and
``PerExampleClipper``; everything private about a step is the DP engine's
(``training/dp/engine.py``). Trained: the top K blocks, the final norm where the feature mode
reads it (``avg``, ``cls``), and the head's linear layer; the rest stays the init repo's. Images
go through the encoder's own transform (the one ``/v1/classify`` applies), without augmentation,
so what the frozen blocks give for each image is computed once, before training, and each step
runs the top blocks only (the same scores as the whole encoder, as the tests check).

The export is the fine-tuned encoder with the head in ``heads/<name>/``. Its ledger holds the
init repo's encoder stages and one DP stage on the dataset whose ``also_trains`` names the head:
one mechanism trained both, so the encoder's and the head's guarantees are that one stage's.

Run it with ``vip-hub train-finetune ...`` or, on several processes or GPUs,
``torchrun --nproc_per_node N -m training.recipes.finetune ...`` (same arguments).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from PIL import Image
from pydantic import Field
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from vip_hub.errors import ConfigError, DataError
from vip_hub.loading import Encoder, load_encoder
from vip_hub.models.features import final_norm, pool_features, vip_layers
from vip_hub.privacy.ledger import DPStage, PrivacyLedger
from vip_hub.repo.heads import HeadInfo, LinearProbe, load_head, save_head
from vip_hub.repo_format import LEDGER_FILE, head_component

from ..data.labelled import LabelledArrays, write_image_folder
from ..dp.run import DPRun
from ..dp.sampling import init_seed
from ..skeleton.config import DPRunConfig, Recipe, recipe_main, tenth_of_steps, with_adamw
from ..skeleton.distributed import Dist
from .probe import (
    HeadData,
    LabelledImages,
    fix_normalisation,
    load_labelled,
    public_features,
    top1_result,
)

__all__ = [
    "RECIPE",
    "STAGE",
    "ArraysRun",
    "Classifier",
    "FinetuneConfig",
    "classifier",
    "evaluate",
    "finetune_arrays",
    "frozen_outputs",
    "train_finetune",
]

STAGE = "dp-finetune"
"""The name of the DP stage in the exported ledger."""
CURVE_IMAGES = 1000
"""At most this many public test images (every k-th) give the curve's loss at each evaluation
(the final top-1 uses all)."""
FinetunePooling = Literal["avg", "cls", "vip"]


class FinetuneConfig(
    HeadData, with_adamw(DPRunConfig, lr=1e-3, warmup=tenth_of_steps, weight_decay=0.05)
):
    """A DP fine-tuning run: cross-entropy on labels, DP-AdamW on the top blocks and a head; the
    test folder's loss is also the card's curve."""

    init: str = Field(description="(Syn)-ViP repo folder or hub id whose encoder is fine-tuned")
    head: str = Field("classifier", description="head name: the repo gets heads/NAME/")
    pooling: FinetunePooling = Field(
        "avg",
        description="feature mode the head reads: avg, cls or vip (the final norm is "
        "trained only where the mode reads it: avg, cls)",
    )
    trainable_blocks: int = Field(
        2,
        ge=1,
        description="top encoder blocks trained with the head (at most all but the first); the "
        "rest stays the init's",
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
        outputs = self.encoder.forward_intermediates(
            images,
            indices=self.indices,
            norm=False,
            output_fmt="NLC",
            return_prefix_tokens=True,
            intermediates_only=True,
            stop_early=True,
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


def classifier(
    init: Encoder, num_classes: int, pooling: FinetunePooling, trainable_blocks: int
) -> Classifier:
    """``init``'s encoder with only its top ``trainable_blocks`` blocks (and its final norm,
    where ``pooling`` reads it) trainable, and a fresh head normalised by public features."""
    encoder, depth = init.model, len(init.model.blocks)
    if trainable_blocks >= depth:
        raise ConfigError(
            f"--trainable-blocks {trainable_blocks}: the {init.spec.arch} encoder has {depth} "
            f"blocks, of which at most {depth - 1} can be trained (the first stays frozen)"
        )
    init.check_pooling(pooling)
    head = LinearProbe(init.feature_dim(pooling), num_classes)
    fix_normalisation(head, public_features(init, pooling))
    encoder.requires_grad_(False)
    trained = list(encoder.blocks[depth - trainable_blocks :])
    if pooling != "vip":  # the vip mode reads the blocks before the final norm
        trained.append(final_norm(encoder))
    for module in trained:
        module.requires_grad_(True)
    return Classifier(encoder, head, pooling, trainable_blocks).train()


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
    model: Classifier,
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


def _public_test(cfg: FinetuneConfig, train: LabelledImages) -> LabelledImages | None:
    if cfg.test_data is None:
        return None
    test = load_labelled(cfg.test_data, "public/test")
    if test.classes != train.classes:
        raise DataError(
            f"--test-data classes {test.classes} differ from --data classes {train.classes}"
        )
    return test


def train_finetune(cfg: FinetuneConfig, dist: Dist | None = None) -> Path:
    """Run (or resume) DP fine-tuning and export the released encoder with its head; returns the
    repo's path."""
    dist = dist or Dist.from_env(cfg.device)
    component = head_component(cfg.head)  # the name is checked before any work
    train = load_labelled(cfg.data, cfg.dataset_name)
    test = _public_test(cfg, train)
    n = len(train.labels)
    run = DPRun(cfg, dist, n)
    init = load_encoder(cfg.init)
    spec, transform = init.spec, init.transform
    torch.manual_seed(init_seed(run.seed))  # the fresh head, the same on every rank
    model = classifier(init, len(train.classes), cfg.pooling, cfg.trainable_blocks)
    model.to(dist.device)
    engine = run.engine(model)

    tokens, means = frozen_outputs(model, transform, train.images, dist.device)
    labels = torch.as_tensor(train.labels)

    def load(index: int, step: int) -> tuple[torch.Tensor, ...]:
        return tokens[index], means[index], labels[index]

    def curve() -> dict[str, float]:
        if test is None:
            return {}
        every = -(-len(test.labels) // CURVE_IMAGES)  # evenly spread: the folder is by class
        loss, top1 = evaluate(
            model, transform, test.images[::every], test.labels[::every].tolist(), dist.device
        )
        return {"public_loss": loss, "public_top1": top1}

    records = engine.train(run, model, load, desc="train-finetune", evaluate=curve)

    depth, k = len(model.encoder.blocks), cfg.trainable_blocks
    trained = sum(p.numel() for p in engine.params)
    norm = " and the final norm" if cfg.pooling != "vip" else ""
    out = run.export_dp(
        model.encoder,
        spec,
        init.ledger,
        records=records,
        curve_label="cross-entropy on public test images"
        if test is not None
        else "no public labelled data: no loss curve",
        dataset_description=f"{n} labelled images, {len(train.classes)} classes; DP fine-tuning",
        summary=(
            f"A {spec.arch} encoder fine-tuned end to end with DP-AdamW on {cfg.dataset_name} "
            f"({n} labelled images), starting from {cfg.init}: the top {k} of {depth} blocks"
            f"{norm} and the linear head heads/{cfg.head} ({cfg.pooling} features), trained "
            "together by one DP stage whose guarantee covers both."
        ),
        name=STAGE,
        also_trains=[component],
        description=(
            f"DP fine-tuning: cross-entropy over {len(train.classes)} classes; DP-AdamW with "
            f"per-example clipping to C = {cfg.max_grad_norm:g}, Gaussian noise sigma x the "
            "sensitivity (C times its fp32 rounding allowance) once per logical step, "
            f"Poisson sampling. Trained together: the top {k} of {depth} "
            f"blocks{norm} and the head {component}'s linear layer ({trained:,} parameters); "
            "the rest of the encoder is the init repo's, unchanged. The head's normalisation "
            "is fixed to the init encoder's features of public procedural images"
        ),
        hyperparameters={
            **cfg.adamw_hyperparameters(),
            "img_size": spec.img_size,
            "pooling": cfg.pooling,
            "trainable_blocks": k,
            "trainable_parameters": trained,
            "augmentation": "none (the encoder's own transform)",
        },
    )
    metrics: dict[str, object] = {"train_size": n, "pooling": cfg.pooling, "fine_tuned_blocks": k}
    result = None
    if test is not None:
        _, top1 = evaluate(model, transform, test.images, test.labels.tolist(), dist.device)
        metrics |= {"top1": top1, "test_data": "public", "test_size": len(test.labels)}
        result = top1_result(
            cfg.test_data, top1, f"top-1, DP fine-tuned head '{cfg.head}' ({cfg.pooling} features)"
        )
    info = HeadInfo(cfg.head, cfg.pooling, train.classes, metrics)
    return run.export(lambda: save_head(out, model.head, info, None, result))


@dataclass(frozen=True)
class ArraysRun:
    """What ``finetune_arrays`` measured: the released repo, its DP stage, the head's top-1 on
    the public test arrays and the recipe's wall time (data written to folders excluded)."""

    repo: Path
    stage: DPStage
    top1: float
    seconds: float


def finetune_arrays(
    init: str | os.PathLike[str],
    train: LabelledArrays,
    test: LabelledArrays,
    work: str | os.PathLike[str],
    *,
    epsilon: float,
    delta: float,
    **settings: Any,
) -> ArraysRun:
    """Fine-tune ``init`` on ``train`` (private, under its dataset's declared name) at
    (``epsilon``, ``delta``) and measure top-1 on ``test`` (public): both written as class folders
    under ``work``, the repo to ``work/finetuned``; ``settings``: other ``FinetuneConfig`` fields
    (a run starts over unless ``restart=False``)."""
    work = Path(work)
    cfg = FinetuneConfig(
        init=str(init),
        data=str(write_image_folder(train, work / "train", train.classes)),
        test_data=str(write_image_folder(test, work / "test", test.classes)),
        out=str(work / "finetuned"),
        dataset_name=train.dataset.name,
        epsilon=epsilon,
        delta=delta,
        **{"restart": True, **settings},
    )
    start = time.perf_counter()
    repo = train_finetune(cfg)
    seconds = time.perf_counter() - start
    ledger = PrivacyLedger.parse((repo / LEDGER_FILE).read_text())
    stage = next(s for s in ledger.dp_stages() if s.name == STAGE)
    return ArraysRun(repo, stage, float(load_head(repo, cfg.head)[1].metrics["top1"]), seconds)


RECIPE = Recipe(
    "finetune",
    "DP fine-tuning: a (Syn)-ViP encoder's top blocks and a linear head on labelled images",
    FinetuneConfig,
    train_finetune,
)

if __name__ == "__main__":
    raise SystemExit(recipe_main("train-finetune"))
