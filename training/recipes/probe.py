"""Linear probes on frozen encoders (the MAE / ViP protocol, App. A.3 of the ViP paper).

Features are computed once from the frozen encoder (``vip`` pooling by default), then the
head, BatchNorm without affine parameters followed by a linear layer, is trained on them:
LARS (timm's) or SGD with momentum, warm-up + cosine schedule. Few-shot mode keeps each
training record with a given probability.

With ``epsilon`` the head is trained with DP-SGD by the DP engine (``training/dp/engine.py``):
its Poisson sampler and noise keyed by a 128-bit secret drawn for the run, and
``PerExampleClipper`` (the clipped sum in fp64, the proved rounding allowance ``fp64-capped``
recorded in the stage, as for every DP stage): the BatchNorm is then fixed to
statistics of *public* features, so only the linear layer sees the labelled data, and the
head's ledger stage is a DP stage naming that dataset. Those statistics (``head_statistics``) are
the mean of the encoder's features of public images from the task's own domain (``--public-data``,
e.g. public test images that score nothing) with variance 1, or without such images the mean and
variance of its features of procedural images. The domain's mean matters: about half of a spatial
mode's squared norm is a component every example shares, which procedural images do not remove
(the benchmarks' README, "the head's centring").
Without ``epsilon`` the stage says plainly that the labelled data has no guarantee.

What a DP head's guarantee rests on is secret and never written anywhere: its noise and its
Poisson sampling come from that secret, and the choice of subsets of the private data (the
held-out split, the few-shot choice) from a key drawn for the run. Subsets are chosen per
record by a keyed hash of the record's bytes, so a record's membership does not change when another
record comes or goes; the stage keeps the dataset's declared name, so it composes with
every other stage on that dataset. Accuracy on a held-out split of the private data is
printed, never written into the repo: only a public test set's figure is published.
"""

from __future__ import annotations

import math
import os
import secrets
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np
import torch
import torch.nn.functional as F
from huggingface_hub import EvalResult
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import nn
from tqdm.auto import tqdm

from vip_hub.errors import ConfigError, DataError
from vip_hub.loading import Encoder, load_encoder
from vip_hub.models.features import Pooling
from vip_hub.privacy.accounting import (
    DEFAULT_DELTA_RULE,
    Accountant,
    calibrate,
    check_delta,
    epsilon,
    resolve_delta,
)
from vip_hub.privacy.ledger import (
    DATASET_NAME_PATTERN,
    Dataset,
    DPStage,
    NonPrivateStage,
    new_run_id,
    noised_key,
)
from vip_hub.privacy.sensitivity import DP_SGD, MIN_CLIP, rounding_params, sensitivity
from vip_hub.repo.heads import HeadInfo, LinearProbe, save_head
from vip_hub.repo_format import ENCODER, HEAD_FOLDER_SHOWN, head_component, head_file

from ..data.images import ImageFolder
from ..data.labelled import keyed_uniforms
from ..data.procedural import SyntheticImages
from ..dp.clipping import PerExampleClipper
from ..dp.engine import Budget, DPEngine
from ..dp.sampling import new_secret
from ..skeleton.config import (
    DeviceName,
    WeakDeltaOption,
    accountant_field,
    check_outside_data,
    device_field,
    overlap,
    tenth_of_steps,
)
from ..skeleton.distributed import Dist
from ..skeleton.optim import lr_factor

__all__ = [
    "PAPER_HEAD_BATCHES",
    "PAPER_HEAD_CLIP",
    "PAPER_HEAD_LR",
    "DPHeadLoss",
    "LabelledImages",
    "ProbeConfig",
    "ProbeResult",
    "PublicComponents",
    "accuracy",
    "centred_statistics",
    "choose_pooling",
    "component_count",
    "dp_head_sampling",
    "dp_head_schedule",
    "fit_probe",
    "fix_normalisation",
    "head_engine",
    "head_statistics",
    "load_head_data",
    "load_labelled",
    "load_public_images",
    "probe_stage",
    "public_components",
    "public_features",
    "right_answers",
    "selection_scores",
    "run_probe",
    "unproject",
    "top1_result",
]

PROBE_MOMENTUM = 0.9
"""The heads' SGD (and LARS) momentum, as their ledger stages record it."""

PAPER_HEAD_LR = 16.0
"""The peak SGD learning rate of a DP linear head on fixed features (Tramer & Boneh 2021's)."""

PAPER_HEAD_CLIP = 0.1
"""The clipping norm C of a DP linear head on fixed features (Tramer & Boneh 2021's)."""

PAPER_HEAD_BATCHES = 8
"""Poisson batches per epoch of a DP linear head (the paper's 8,192 of 60,000: q about 1/8)."""


@dataclass
class LabelledImages:
    """Images with integer labels, their class names, their files, and the dataset's ledger
    identity."""

    images: list[Image.Image]
    labels: np.ndarray
    classes: list[str]
    dataset: Dataset
    files: list[Path]


def load_labelled(
    path: str | os.PathLike[str], name: str, classes: Sequence[str] | None = None
) -> LabelledImages:
    """An image folder with one subfolder per class, named ``name`` in ledgers; its label space
    ``classes`` (PUBLIC: a subfolder outside them is a DataError), else its subfolders' names."""
    folder = ImageFolder(path)
    members = [
        (i, p.relative_to(folder.root).parts[0])
        for i, p in enumerate(folder.files)
        if len(p.relative_to(folder.root).parts) > 1
    ]  # files in a class subfolder
    present = sorted({c for _, c in members})
    if classes is None:
        classes = present
    elif unknown := sorted(set(present) - set(classes)):
        raise DataError(f"{path}: class folders {unknown} are not among the classes {classes}")
    classes = list(classes)
    if len(classes) < 2:
        raise DataError(
            f"{path} needs one subfolder per class (found {len(classes)} class folders)"
        )
    index = {c: i for i, c in enumerate(classes)}
    images = [folder.load(i) for i, _ in members]
    labels = np.array([index[c] for _, c in members])
    dataset = Dataset(
        name=name,
        size=len(members),
        description=f"{len(members)} labelled images, {len(classes)} classes",
    )
    return LabelledImages(images, labels, classes, dataset, [folder.files[i] for i, _ in members])


def load_head_data(
    cfg: HeadData, dataset_name: str, *, dp: bool
) -> tuple[LabelledImages, LabelledImages | None]:
    """``cfg.data`` (named ``dataset_name``) and the PUBLIC ``cfg.test_data``: a head's labels
    are PUBLIC, whichever of them the private records hold: the test data's classes, else the
    declared ``cfg.classes``. A ``dp`` head with neither is refused (its labels would be the
    private folders': a class whose records are all gone would vanish from the release); a
    non-private head then takes ``cfg.data``'s class folders."""
    declared = cfg.declared_classes
    if dp and declared is None and not cfg.test_data:
        raise ConfigError(
            "a DP head's labels must be public: give --classes (e.g. --classes cat,dog) or "
            "--test-data (public labelled images), not the private --data's class folders"
        )
    test = load_labelled(cfg.test_data, "public/test") if cfg.test_data else None
    if test is not None and declared is not None and declared != test.classes:
        raise ConfigError(
            f"--classes {declared} must be the --test-data's classes {test.classes}, in that order"
        )
    train = load_labelled(cfg.data, dataset_name, test.classes if test is not None else declared)
    return train, test


class HeadData(BaseModel):
    """The labelled folders a classifier head (a probe, a fine-tuned classifier) trains and is
    tested on: the settings every head recipe shares (first in a recipe's bases, so its ``data``
    help, which names the layout, is the one shown)."""

    model_config = ConfigDict(extra="forbid")

    data: str = Field(
        description="labelled image folder, one subfolder per class: the head's training data"
    )
    test_data: str | None = Field(
        None,
        description="PUBLIC labelled test folder: its classes are the head's labels (a class "
        "folder of --data outside them is refused), its top-1 goes on the card and in the head's "
        "metrics",
    )
    classes: str | list[str] | None = Field(
        None,
        description="the head's labels, comma-separated (PUBLIC: a class folder of --data "
        "outside them is refused); with --test-data they must be its classes; a DP head needs "
        "them or --test-data",
    )
    public_data: str | None = Field(
        None,
        description="PUBLIC images from the task's domain (a folder, labels not needed; never "
        "the --test-data that scores the head): a DP head's features are centred on their mean "
        "(without it: procedural images' statistics, a weaker head)",
    )

    @field_validator("classes", mode="before")
    @classmethod
    def _split_classes(cls, value: Any) -> Any:
        names = [c.strip() for c in value.split(",")] if isinstance(value, str) else value
        if isinstance(names, list):
            if "" in names:
                raise ValueError(f"an empty class name in {names}")
            if twice := sorted({c for c in names if names.count(c) > 1}):
                raise ValueError(f"classes named twice: {twice}")
        return names

    @property
    def declared_classes(self) -> list[str] | None:
        """``classes`` as a list (``_split_classes`` parsed a comma-separated string)."""
        assert not isinstance(self.classes, str)
        return self.classes

    @model_validator(mode="after")
    def _public_data_scores_nothing(self) -> HeadData:
        if self.public_data and self.test_data:
            if Path(self.public_data).resolve() == Path(self.test_data).resolve():
                raise ValueError(
                    "--public-data is --test-data: the images that centre a head must not "
                    "score it (give other public images of the domain)"
                )
        return self


class ProbeConfig(HeadData, WeakDeltaOption):
    """A linear-probe run. Defaults follow the MAE linear-probe recipe, scaled to small data."""

    encoder: str = Field(description="encoder repo folder or hub repo id")
    test_fraction: float = Field(
        0.2,
        gt=0,
        lt=1,
        description="held-out share of --data when --test-data is not given: records chosen by "
        "a keyed hash under a secret; its top-1 is printed, never put on the card",
    )
    head: str = Field("probe", description=f"head name: the repo gets {HEAD_FOLDER_SHOWN}")
    pooling: str = Field(
        "vip",
        description="feature mode: vip (the paper's), avg, cls, a family's own, or a spatial "
        "mode the repo declares (spatial-b<blocks>-g<grid>: small images, layout-bound classes)",
    )
    epochs: int = Field(90, gt=0, description="training epochs")
    warmup_epochs: int = Field(10, ge=0, description="warm-up epochs")
    batch_size: int = Field(256, gt=0, description="batch size (a DP head's expected batch)")
    optimizer: Literal["lars", "sgd"] = Field("lars", description="lars or sgd (DP heads use SGD)")
    lr: float = Field(0.1, gt=0, description="peak learning rate")
    weight_decay: float = Field(0.0, ge=0, description="weight decay")
    few_shot_rate: float | None = Field(
        None,
        gt=0,
        le=1,
        description="few-shot probe: keep each training record with this probability, by a keyed "
        "hash under a secret (about k per class for k x classes / n)",
    )
    epsilon: float | None = Field(
        None, gt=0, description="train the head with DP-SGD at this epsilon"
    )
    delta: float | None = Field(
        None,
        gt=0,
        lt=1,
        description=f"delta (default {DEFAULT_DELTA_RULE} of the probe's training set)",
    )
    max_grad_norm: float = Field(1.0, ge=MIN_CLIP, description="clipping norm of a DP head")
    accountant: Accountant = accountant_field()
    dataset_name: str = Field(
        pattern=DATASET_NAME_PATTERN,
        description="the labelled data's declared name, namespaced (e.g. org/digits-train): "
        "its identity in ledgers; the head's stage composes with every stage on it",
    )
    seed: int = Field(
        0,
        description="seed of a head's initialisation and of a non-private head's batches (a DP "
        "head's noise and sampling, and subsets of --data, use a secret drawn per run)",
    )
    out: str | None = Field(
        None, description="repo folder to write with the head (default: the encoder folder)"
    )
    export: bool = Field(True, description="add the head to the repo")
    device: DeviceName = device_field("cpu")

    @model_validator(mode="after")
    def _repo_outside_data(self) -> ProbeConfig:
        given = bool(self.encoder) and Path(self.encoder).is_dir()  # "" would be the cwd
        folder = Path(self.encoder).resolve() if given else None
        if self.out is not None:
            check_outside_data("--out", self.out, self.data)
            if (
                folder is not None
                and Path(self.out).resolve() != folder
                and overlap(self.out, folder)
            ):
                raise ValueError(
                    f"--out {self.out} and the encoder folder {self.encoder} overlap: the copy "
                    "with the head would be written into the encoder's repo (or hold it); give "
                    "the encoder folder itself or a folder apart from it"
                )
        elif folder is not None:  # the head goes into its folder
            check_outside_data("the encoder folder", self.encoder, self.data)
        return self


def dp_head_schedule(
    n: int, epochs: int, batches: int = PAPER_HEAD_BATCHES, batch_size: int | None = None
) -> dict[str, Any]:
    """A DP linear head's schedule on ``n`` records, as ``ProbeConfig`` fields: SGD for
    ``epochs``, a tenth of them warming up, an expected batch of ``batch_size`` or else of
    n / ``batches`` rounded up."""
    return {
        "optimizer": "sgd",
        "epochs": epochs,
        "warmup_epochs": tenth_of_steps(epochs),
        "batch_size": batch_size or math.ceil(n / batches),
    }


@dataclass
class ProbeResult:
    top1: float
    train_size: int
    test_size: int
    head: LinearProbe
    stage: NonPrivateStage | DPStage
    repo: Path | None
    features: dict[str, torch.Tensor]  # train_x, train_y, test_x, test_y (to compare other heads)


def _optimizer(params: Any, name: str, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    if name == "lars":
        from timm.optim import Lars

        return Lars(params, lr=lr, momentum=PROBE_MOMENTUM, weight_decay=weight_decay)
    return torch.optim.SGD(params, lr=lr, momentum=PROBE_MOMENTUM, weight_decay=weight_decay)


def fit_probe(
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    num_classes: int,
    cfg: ProbeConfig,
    public_x: torch.Tensor | None = None,
    desc: str = "probe",
) -> tuple[LinearProbe, dict[str, Any]]:
    """Train a head on fixed features. With ``cfg.epsilon``: DP-SGD (the DP engine) on the linear
    layer, BatchNorm fixed to ``public_x`` statistics, noise and sampling from a fresh secret.
    Returns the head (eval mode) and the DP parameters used (empty without DP)."""
    torch.manual_seed(cfg.seed)
    head = LinearProbe(train_x.shape[1], num_classes)
    n = len(train_x)
    batch = min(cfg.batch_size, n)
    steps_per_epoch = _steps_per_epoch(n, cfg)
    total = cfg.epochs * steps_per_epoch
    warmup = cfg.warmup_epochs * steps_per_epoch
    loss_fn = nn.CrossEntropyLoss()
    bar = tqdm(total=total, desc=desc, unit="step", leave=False)
    dp: dict[str, Any] = {}
    if cfg.epsilon is None:
        opt = _optimizer(head.parameters(), cfg.optimizer, cfg.lr, cfg.weight_decay)
        g = torch.Generator().manual_seed(cfg.seed)
        head.train()
        step = 0
        for _ in range(cfg.epochs):
            for idx in torch.randperm(n, generator=g).split(batch):
                if (
                    len(idx) < 2
                ):  # BatchNorm cannot train on one example: a last batch of one is skipped
                    continue
                for group in opt.param_groups:
                    group["lr"] = cfg.lr * lr_factor(step, warmup, total)
                loss = loss_fn(head(train_x[idx]), train_y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
                bar.update(1)
    else:
        dp = _fit_dp(head, train_x, train_y, cfg, public_x, steps_per_epoch, bar)
    bar.close()
    return head.eval(), dp


def _steps_per_epoch(n: int, cfg: ProbeConfig) -> int:
    """Batches of ``cfg.batch_size`` (at most ``n``) in one pass over ``n`` records."""
    return math.ceil(n / min(cfg.batch_size, n))


def dp_head_sampling(n: int, cfg: ProbeConfig) -> tuple[float, int]:
    """A DP head's sample rate and steps on ``n`` records: Poisson samples of an expected batch
    of n / (batches per pass), for ``cfg.epochs`` passes. Known before training,
    so a head can be calibrated to compose with earlier stages (``remaining_epsilon``)."""
    per_epoch = _steps_per_epoch(n, cfg)
    return 1.0 / per_epoch, cfg.epochs * per_epoch


class DPHeadLoss(nn.Module):
    """A DP head's per-example loss: cross-entropy of its linear layer on normalised features."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.linear(x), y, reduction="none")


def _fit_dp(
    head: LinearProbe,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: ProbeConfig,
    public_x: torch.Tensor | None,
    steps_per_epoch: int,
    bar: tqdm,
) -> dict[str, Any]:
    if public_x is None:
        raise ConfigError("a DP head needs public features to fix its normalisation")
    fix_normalisation(head, public_x)
    normed = head.norm(x).detach()
    q, steps = dp_head_sampling(len(x), cfg)
    optimizer = torch.optim.SGD(head.linear.parameters(), lr=cfg.lr, momentum=PROBE_MOMENTUM)
    engine, dp = head_engine(DPHeadLoss(head.linear), optimizer, len(x), q, steps, cfg)
    warmup = cfg.warmup_epochs * steps_per_epoch
    for step in range(steps):
        batch = torch.as_tensor(engine.plan(step))
        for group in engine.optimizer.param_groups:
            group["lr"] = cfg.lr * lr_factor(step, warmup, steps)
        engine.step(step, [(normed[batch], y[batch])] if len(batch) else [])
        bar.update(1)
    dp["noised"] = {
        noised_key(head_file(cfg.head), f"linear.{name}"): p.numel()
        for name, p in head.linear.named_parameters()
    }
    return dp


def head_engine(
    loss: nn.Module,
    optimizer: torch.optim.Optimizer,
    n: int,
    q: float,
    steps: int,
    cfg: ProbeConfig,
) -> tuple[DPEngine, dict[str, Any]]:
    """The DP engine of a head on ``n`` records whose per-example ``loss`` (a module of
    (features, labels)) the engine clips to ``cfg.max_grad_norm`` for ``steps`` Poisson samples at
    rate ``q``, calibrated to ``cfg.epsilon``; and the head's DP parameters (``noised`` to add)."""
    delta = resolve_delta(cfg.delta, n)
    check_delta(delta, n, cfg.allow_weak_delta)
    kind = Accountant(cfg.accountant)
    if cfg.epsilon is None:
        raise ConfigError("a DP head needs an epsilon")
    sigma = calibrate(cfg.epsilon, delta, q, steps, kind)
    # The engine refuses a step whose sample holds more than the b the allowance covers.
    params = rounding_params(n, q)
    budget = Budget(n, n * q, sigma, delta, kind, steps, steps, cfg.epsilon)
    # The mechanism's randomness: a 128-bit secret per run, never stored (a public seed would
    # let anyone who knows all but one record replay the head's training in both worlds); it
    # keys the Poisson sample and the noise of every step.
    engine = DPEngine(
        PerExampleClipper(loss, cfg.max_grad_norm),
        optimizer,
        None,
        budget,
        sensitivity=sensitivity(DP_SGD, cfg.max_grad_norm, params),
        clipping_norm=cfg.max_grad_norm,
        seed=new_secret(),
        dist=Dist(),
        micro_batch_size=None,
    )
    return engine, {
        "sigma": sigma,
        "sample_rate": q,
        "steps": steps,
        "delta": delta,
        "accountant": kind,
        "sensitivity": engine.sensitivity,
        "mechanism_params": params,
    }


@overload
def public_features(encoder: Encoder, pooling: Pooling) -> torch.Tensor: ...


@overload
def public_features(
    encoder: Encoder, pooling: tuple[Pooling, ...]
) -> dict[Pooling, torch.Tensor]: ...


def public_features(
    encoder: Encoder, pooling: Pooling | tuple[Pooling, ...]
) -> torch.Tensor | dict[Pooling, torch.Tensor]:
    """``encoder``'s ``pooling`` features (a dict for a tuple of modes) of public procedural
    images (no private data): what fixes a DP head's normalisation."""
    synth = SyntheticImages(encoder.spec.img_size, seed=1)
    return encoder.embed(torch.stack([synth[i] for i in range(256)]), pooling)


def choose_pooling(
    encoder: Encoder,
    images: Sequence[Image.Image],
    labels: np.ndarray,
    num_classes: int,
    cfg: ProbeConfig,
    private_n: int,
    components: int = 0,
) -> tuple[Pooling, dict[Pooling, float]]:
    """The feature mode of ``encoder`` that a head trained by ``cfg`` on ``private_n`` private
    records should read, chosen on PUBLIC labelled ``images`` only: every mode of the encoder
    scored by ``selection_scores`` (its ``encoder_poolings``: never ``pixels``, which reads no
    weight). Returns the best mode and every score."""
    scores = selection_scores(
        encoder.embed(images, encoder.encoder_poolings),
        labels,
        num_classes,
        cfg,
        private_n,
        components,
    )
    return max(scores, key=lambda m: scores[m]), scores


def selection_scores(
    feats: Mapping[str, torch.Tensor],
    labels: np.ndarray,
    num_classes: int,
    cfg: ProbeConfig,
    private_n: int,
    components: int = 0,
    basis: int | None = None,
) -> dict[str, float]:
    """Each of the PUBLIC features ``feats`` (name -> (N, D), labels ``labels``) scored for a
    head trained by ``cfg`` on ``private_n`` private records: the mean top-1 (%) of two heads,
    one fit on each half of the records and scored on the other (each head's noise drawn
    afresh). A DP ``cfg``'s heads keep its sample rate and steps, and their noise multiplier is
    scaled by the ratio of the expected batches, so that the noise on their averaged gradient is
    the private head's (their epsilon on the public records means nothing), and their features
    are centred on all the records' mean (``centred_statistics``: the rule of a head given these
    records as ``--public-data``); with ``components`` > 0 every head reads the top principal
    components (``component_count``) of the features of the first ``basis`` records (default
    all: the study's heads take theirs from the centring records, and 1,000 rows of 3,072
    features decompose 20 times faster than 8,000)."""
    half = len(labels) // 2
    if half < 2:
        raise DataError(f"choosing on public records needs at least 4 of them, not {len(labels)}")
    y = torch.as_tensor(labels)
    fit = cfg
    if cfg.epsilon is not None:
        q, steps = dp_head_sampling(private_n, cfg)
        delta = resolve_delta(cfg.delta, private_n)
        sigma = calibrate(cfg.epsilon, delta, q, steps, cfg.accountant)
        fit = cfg.model_copy(update={"batch_size": max(1, round(half * q))})
        q_fit, steps_fit = dp_head_sampling(half, fit)
        matched = sigma * (half * q_fit) / (private_n * q)
        eps = epsilon(matched, q_fit, steps_fit, delta, cfg.accountant)
        fit = fit.model_copy(update={"epsilon": eps, "delta": delta})
    halves = (slice(0, half), slice(half, 2 * half))
    scores = {}
    for mode, x in feats.items():
        if k := component_count(x[:basis], components):
            x = public_components(x[:basis], k)(x)
        top1 = []
        public = centred_statistics(x) if cfg.epsilon is not None else None
        for fit_on, score_on in (halves, halves[::-1]):
            head, _ = fit_probe(
                x[fit_on], y[fit_on], num_classes, fit, public, desc=f"choose {mode}"
            )
            top1.append(accuracy(head, x[score_on], y[score_on]))
        scores[mode] = 100 * sum(top1) / len(top1)
    return scores


def centred_statistics(domain_x: torch.Tensor) -> torch.Tensor:
    """Two rows whose mean is that of ``domain_x`` (features of PUBLIC images from the task's
    domain) and whose variance is 1: fixing a DP head's BatchNorm to them centres its features
    (removing the component all examples share) and keeps each example's own normalisation."""
    if not len(domain_x):
        raise DataError("centring a DP head needs at least one public image of the domain")
    mean = domain_x.mean(0, keepdim=True)
    return torch.cat([mean + 1, mean - 1])


@dataclass(frozen=True)
class PublicComponents:
    """The top principal directions of features of PUBLIC records (``public_components``): the
    records' mean (1, D) and the directions (D, k), scaled so that their centred features keep
    their mean norm. Called on features (N, D), it gives their components (N, k)."""

    mean: torch.Tensor
    directions: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return ((x.double() - self.mean) @ self.directions).to(x.dtype)


def component_count(public_x: torch.Tensor, k: int) -> int:
    """The principal components of the public features ``public_x`` a head asked for ``k`` reads:
    at most one fewer than the records and their dimension (0: the features themselves)."""
    return max(0, min(k, len(public_x) - 1, public_x.shape[1]))


def _top_directions(centred: torch.Tensor, k: int) -> torch.Tensor:
    """The top ``k`` right singular vectors (D, k) of the fp64 ``centred`` (N, D), from the
    eigenvectors of the smaller of its two Grams (LAPACK's SVD of a 1,000 x 9,408 matrix took 13
    times as long); a direction the records do not span (eigenvalue within rounding of 0) is 0,
    and each direction's largest coordinate is positive (the sign is otherwise arbitrary)."""
    wide = centred.shape[1] > centred.shape[0]
    values, vectors = torch.linalg.eigh(centred @ centred.T if wide else centred.T @ centred)
    values, vectors = values.flip(0)[:k], vectors.flip(1)[:, :k]
    spanned = values > values[0].clamp(min=0) * max(centred.shape) * torch.finfo(torch.float64).eps
    scale = torch.where(spanned, values.clamp(min=torch.finfo(torch.float64).tiny).rsqrt(), 0.0)
    directions = centred.T @ vectors * scale if wide else vectors * spanned
    largest = directions.gather(0, directions.abs().argmax(0, keepdim=True))
    return directions * torch.where(largest < 0, -1.0, 1.0)


def public_components(public_x: torch.Tensor, k: int) -> PublicComponents:
    """The map of features onto the top ``k`` principal directions of ``public_x``, features of
    PUBLIC records: fixed by public data, so a DP head may read it in place of the features (fewer
    coordinates for its noise) at no privacy cost."""
    if not 0 < k <= min(public_x.shape):
        raise DataError(f"{k} principal components of {tuple(public_x.shape)} public features")
    mean = public_x.double().mean(0, keepdim=True)
    centred = public_x.double() - mean
    directions = _top_directions(centred, k)
    kept = (centred @ directions).norm(dim=1).mean()
    if not kept > 0:
        raise DataError(f"the {len(public_x)} public features do not vary: no components to read")
    return PublicComponents(mean, directions * centred.norm(dim=1).mean() / kept)


@torch.no_grad()
def unproject(
    head: LinearProbe, components: PublicComponents, public_x: torch.Tensor
) -> LinearProbe:
    """The head on the features themselves that answers as ``head`` does on their
    ``components``, its BatchNorm fixed to ``public_x``'s statistics: its linear layer is
    ``head``'s folded through the map (post-processing of ``head``: no privacy cost)."""
    full = LinearProbe(components.directions.shape[0], head.linear.out_features)
    fix_normalisation(full, public_x)
    norm, into = head.norm, full.norm
    assert norm.running_mean is not None and norm.running_var is not None
    assert into.running_mean is not None and into.running_var is not None
    a = head.linear.weight.double() / (norm.running_var.double() + norm.eps).sqrt()  # (C, k)
    folded = a @ components.directions.T  # (C, D): the map's directions, read from the features
    shift = into.running_mean.double() - components.mean[0]
    full.linear.weight.copy_(folded * (into.running_var.double() + into.eps).sqrt())
    full.linear.bias.copy_(
        head.linear.bias.double() - a @ norm.running_mean.double() + folded @ shift
    )
    return full.eval()


def head_statistics(
    encoder: Encoder, pooling: Pooling, domain: Sequence[Image.Image] | None = None
) -> torch.Tensor:
    """What fixes a DP head's BatchNorm on ``encoder``'s ``pooling`` features: centred on its
    features of the PUBLIC ``domain`` images when given, else its procedural features' own."""
    if domain:
        return centred_statistics(encoder.embed(list(domain), pooling))
    return public_features(encoder, pooling)


def load_public_images(path: str | os.PathLike[str]) -> list[Image.Image]:
    """Every image under the folder ``path`` (recursively: labelled or not), for PUBLIC use."""
    folder = ImageFolder(path)
    return [folder.load(i) for i in range(len(folder))]


def fix_normalisation(head: LinearProbe, public_x: torch.Tensor) -> None:
    """Fix ``head``'s BatchNorm to the statistics of ``public_x`` (eval mode: it then reads no
    statistic across examples, and its input's privacy rests on the features alone)."""
    # optional in BatchNorm (without running statistics); a LinearProbe's norm keeps them
    assert head.norm.running_mean is not None and head.norm.running_var is not None
    with torch.no_grad():
        head.norm.running_mean.copy_(public_x.mean(0))
        head.norm.running_var.copy_(public_x.var(0, unbiased=False))
    head.norm.eval()


@torch.no_grad()
def right_answers(head: LinearProbe, x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
    """Whether ``head`` answers each of the features ``x`` with its label ``y``, (n,) booleans."""
    with torch.no_grad():
        return (head.eval()(x).argmax(1) == y).numpy()


def accuracy(head: LinearProbe, x: torch.Tensor, y: torch.Tensor) -> float:
    """Top-1 of ``head`` on ``x`` (nan without records)."""
    return float(right_answers(head, x, y).mean()) if len(y) else float("nan")


def run_probe(cfg: ProbeConfig) -> ProbeResult:
    """Extract features, fit the head, evaluate, and (with ``cfg.export``) add it to the repo."""
    head_component(cfg.head)  # validate the name before any work
    encoder = load_encoder(cfg.encoder, device=cfg.device)
    train, test = load_head_data(cfg, cfg.dataset_name, dp=cfg.epsilon is not None)
    key = secrets.token_bytes(32)  # chooses subsets of the private data; never stored
    n, tr_idx = len(train.labels), np.arange(len(train.labels))
    if test is not None:
        test_images, test_y = test.images, test.labels
    else:
        held_out = keyed_uniforms(key, "held-out", train.files, train.labels) < cfg.test_fraction
        tr_idx, te_idx = np.flatnonzero(~held_out), np.flatnonzero(held_out)
        test_images, test_y = [train.images[i] for i in te_idx], train.labels[te_idx]
    if cfg.few_shot_rate:  # a public rate: no record's membership depends on any other record
        kept = (
            keyed_uniforms(key, "few-shot", [train.files[i] for i in tr_idx], train.labels[tr_idx])
            < cfg.few_shot_rate
        )
        tr_idx = tr_idx[kept]
    if not len(tr_idx) or not len(test_y):
        raise DataError(
            f"{cfg.data}: the keyed choice left {len(tr_idx)} training and {len(test_y)} test "
            "examples"
        )
    pooling = cfg.pooling
    train_x = encoder.embed([train.images[i] for i in tr_idx], pooling)
    test_x = encoder.embed(test_images, pooling)
    train_y, test_t = torch.as_tensor(train.labels[tr_idx]), torch.as_tensor(test_y)
    domain = load_public_images(cfg.public_data) if cfg.public_data else None
    public_x = head_statistics(encoder, pooling, domain) if cfg.epsilon is not None else None
    head, dp = fit_probe(
        train_x, train_y, len(train.classes), cfg, public_x, desc=f"probe {cfg.head}"
    )
    top1 = accuracy(head, test_x, test_t)
    # The head's stage keeps the dataset's name (it composes with every stage on it) and the n it
    # saw.
    used = (
        train.dataset
        if len(tr_idx) == n
        else Dataset(
            name=train.dataset.name,
            size=len(tr_idx),
            description=(
                f"{len(tr_idx)} of the {n} labelled images, each record chosen by a keyed hash "
                "under a secret (its membership does not depend on any other record)"
            ),
        )
    )
    stage = probe_stage(cfg, used, dp)
    public_top1 = top1 if cfg.test_data else None
    repo = (
        _export(cfg, encoder, head, train.classes, stage, public_top1, len(tr_idx))
        if cfg.export
        else None
    )
    features = {"train_x": train_x, "train_y": train_y, "test_x": test_x, "test_y": test_t}
    return ProbeResult(top1, len(tr_idx), len(test_y), head, stage, repo, features)


def probe_stage(
    cfg: ProbeConfig, data: Dataset, dp: dict[str, Any], *, fine_tuned: bool = False
) -> NonPrivateStage | DPStage:
    """The ledger stage of a probe head fit by ``fit_probe`` (``dp``: its DP parameters, empty
    without DP); ``fine_tuned``: a DP fine-tuning of the encoder starts from this head, so the
    stage is the encoder's too (component ``encoder``, the head in ``also_trains``)."""
    component = head_component(cfg.head)
    protocol = f"{cfg.pooling} features, BatchNorm + linear, {cfg.epochs} epochs"
    if not dp:
        return NonPrivateStage(
            name=f"linear-probe:{cfg.head}",
            component=component,
            dataset=data,
            private_data=True,
            description=f"linear probe ({protocol}, {cfg.optimizer}) trained without DP: its "
            "labelled data has no privacy guarantee",
        )
    start = (
        "; the head a DP fine-tuning of the encoder starts from, so the fine-tuned encoder and "
        "head depend on it too"
        if fine_tuned
        else ""
    )
    return DPStage.from_parameters(
        name=f"linear-probe-dp:{cfg.head}",
        component=ENCODER if fine_tuned else component,
        also_trains=[component] if fine_tuned else [],
        dataset=data,
        mechanism=DP_SGD,
        mechanism_params=dp["mechanism_params"],
        sensitivity=dp["sensitivity"],
        sample_rate=dp["sample_rate"],
        noise_multiplier=dp["sigma"],
        steps=dp["steps"],
        clipping_norm=cfg.max_grad_norm,
        noised_tensors=dp["noised"],
        delta=dp["delta"],
        accountant=dp["accountant"],
        run_id=new_run_id(),
        description=f"linear probe ({protocol}) trained with DP-SGD (per-example clipping, its "
        "sum formed in fp64 and rounded once); normalisation fixed to public features ("
        + ("centred on public images of the domain" if cfg.public_data else "procedural images")
        + f"){start}",
        hyperparameters={
            "lr": cfg.lr,
            "epochs": cfg.epochs,
            "momentum": PROBE_MOMENTUM,
            "pooling": cfg.pooling,
        },
    )


def top1_result(test_data: str | None, top1: float, metric_name: str) -> EvalResult:
    """The card's result for a head's top-1 on the public labelled folder ``test_data``."""
    name = Path(test_data or "").name
    return EvalResult(
        task_type="image-classification",
        dataset_type=name,
        dataset_name=f"{name} (public test data)",
        metric_type="accuracy",
        metric_value=round(top1, 4),
        metric_name=metric_name,
    )


def _export(
    cfg: ProbeConfig,
    encoder: Any,
    head: LinearProbe,
    classes: list[str],
    stage: NonPrivateStage | DPStage,
    public_top1: float | None,
    n_train: int,
) -> Path:
    """Add the head to the repo; its accuracy is written only when measured on public test data."""
    src = Path(encoder.path)
    if cfg.out:
        out = Path(cfg.out)
        if out.resolve() != src.resolve():
            if out.exists():
                raise ConfigError(f"{out} exists; give the encoder folder itself or a new --out")
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
            try:  # the copy with its head appears at --out whole, or not at all
                shutil.copytree(src, tmp, dirs_exist_ok=True)
                _save(cfg, tmp, head, classes, stage, public_top1, n_train)
                tmp.rename(out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            return out
    elif Path(cfg.encoder).is_dir():
        out = src
    else:
        raise ConfigError(
            "the encoder came from a hub: pass --out DIR to write a repo folder with the head"
        )
    _save(cfg, out, head, classes, stage, public_top1, n_train)
    return out


def _save(
    cfg: ProbeConfig,
    out: Path,
    head: LinearProbe,
    classes: list[str],
    stage: NonPrivateStage | DPStage,
    public_top1: float | None,
    n_train: int,
) -> None:
    """``save_head`` of the head into the repo ``out``, with its metrics and card result."""
    dp_note = f", DP epsilon {stage.epsilon:.3g}" if isinstance(stage, DPStage) else ", no DP"
    metrics: dict[str, object] = {
        "train_size": n_train,
        "few_shot_rate": cfg.few_shot_rate,
        "epochs": cfg.epochs,
    }
    result = None
    if public_top1 is not None:
        metrics |= {"top1": public_top1, "test_data": "public"}
        result = top1_result(
            cfg.test_data,
            public_top1,
            f"top-1, linear probe '{cfg.head}' ({cfg.pooling} features{dp_note})",
        )
    save_head(out, head, HeadInfo(cfg.head, cfg.pooling, classes, metrics), stage, result)
