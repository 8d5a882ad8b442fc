"""Linear probes on frozen encoders (the MAE / ViP protocol, App. A.3 of the ViP paper).

Features are computed once from the frozen encoder (``vip`` pooling by default), then the
head, BatchNorm without affine parameters followed by a linear layer, is trained on them:
LARS (timm's) or SGD with momentum, warm-up + cosine schedule. Few-shot mode keeps k
training examples per class.

With ``epsilon`` the head is trained with DP-SGD by Opacus (Poisson sampling, per-example
clipping, the same RDP/PRV accountants): the BatchNorm is then fixed to statistics of
*public* features (the encoder's features of procedural images), so only the linear layer
sees the labelled data, and the head's ledger stage is a DP stage naming that dataset.
Without ``epsilon`` the stage says plainly that the labelled data has no guarantee.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from huggingface_hub import EvalResult
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from tqdm.auto import tqdm

from vip_hub.accounting import Accountant, calibrate, default_delta
from vip_hub.errors import ConfigError, DataError
from vip_hub.heads import HeadInfo, LinearProbe, save_head
from vip_hub.repo_format import head_component
from vip_hub.ledger import Dataset, DPStage, NonPrivateStage
from vip_hub.loading import load_encoder

from .data import ImageFolder
from .synthetic import SyntheticImages
from .optim import lr_factor

__all__ = ["LabelledImages", "ProbeConfig", "ProbeResult", "fit_probe", "load_labelled", "run_probe"]


@dataclass
class LabelledImages:
    """Images with integer labels, their class names, and the dataset's ledger identity."""

    images: list[Image.Image]
    labels: np.ndarray
    classes: list[str]
    dataset: Dataset


def load_labelled(path: str | os.PathLike[str], name: str | None = None) -> LabelledImages:
    """An image folder with one subfolder per class."""
    folder = ImageFolder(path)
    members = [(i, p.relative_to(folder.root).parts[0]) for i, p in enumerate(folder.files)
               if len(p.relative_to(folder.root).parts) > 1]  # files in a class subfolder
    classes = sorted({c for _, c in members})
    if len(classes) < 2:
        raise DataError(f"{path} needs one subfolder per class (found {len(classes)} class folders)")
    index = {c: i for i, c in enumerate(classes)}
    images = [folder.load(i) for i, _ in members]
    labels = np.array([index[c] for _, c in members])
    dataset = Dataset(name=name or folder.name, size=len(members), fingerprint=folder.fingerprint(),
                      description=f"{len(members)} labelled images, {len(classes)} classes")
    return LabelledImages(images, labels, classes, dataset)


class ProbeConfig(BaseModel):
    """A linear-probe run. Defaults follow the MAE linear-probe recipe, scaled to small data."""

    model_config = ConfigDict(extra="forbid")

    encoder: str = Field(description="encoder repo folder or hub repo id")
    data: str = Field(description="labelled image folder (one subfolder per class): the probe's training data")
    test_data: str | None = Field(None, description="labelled test folder (default: a stratified split of --data)")
    test_fraction: float = Field(0.2, gt=0, lt=1, description="held-out share when --test-data is not given")
    head: str = Field("probe", description="head name: the repo gets heads/NAME/")
    pooling: str = Field("vip", description="feature mode: vip (the paper's), avg, cls, or a family's own")
    epochs: int = Field(90, gt=0, description="training epochs")
    warmup_epochs: int = Field(10, ge=0, description="warm-up epochs")
    batch_size: int = Field(256, gt=0, description="batch size (a DP head's expected batch)")
    optimizer: Literal["lars", "sgd"] = Field("lars", description="lars or sgd (DP heads use SGD)")
    lr: float = Field(0.1, gt=0, description="peak learning rate")
    weight_decay: float = Field(0.0, ge=0, description="weight decay")
    few_shot: int | None = Field(None, gt=0, description="keep k training examples per class")
    epsilon: float | None = Field(None, gt=0, description="train the head with DP-SGD at this epsilon")
    delta: float | None = Field(None, gt=0, lt=1, description="delta (default 1/(2n) of the probe's training set)")
    max_grad_norm: float = Field(1.0, gt=0, description="clipping norm of a DP head")
    accountant: Accountant = Field(Accountant.RDP, description="the accountant whose epsilon is the claim")
    dataset_name: str | None = Field(None, description="the ledger's name for the labelled data")
    seed: int = Field(0, description="seed of the split, the few-shot choice and the head's training")
    out: str | None = Field(None, description="repo folder to write with the head (default: the encoder folder)")
    export: bool = Field(True, description="add the head to the repo")
    device: str = Field("cpu", description="auto, cpu, cuda or cuda:N")


@dataclass
class ProbeResult:
    top1: float
    train_size: int
    test_size: int
    head: LinearProbe
    stage: NonPrivateStage | DPStage
    repo: Path | None
    features: dict[str, torch.Tensor]  # train_x, train_y, test_x, test_y (to compare other heads)


def _split(labels: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.model_selection import train_test_split

    idx = np.arange(len(labels))
    train, test = train_test_split(idx, test_size=fraction, random_state=seed, stratify=labels)
    return np.sort(train), np.sort(test)


def _few_shot(labels: np.ndarray, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    keep = []
    for c in np.unique(labels):
        members = np.flatnonzero(labels == c)
        keep.extend(rng.choice(members, size=min(k, len(members)), replace=False))
    return np.sort(np.array(keep))


def _optimizer(params: Any, name: str, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    if name == "lars":
        from timm.optim import Lars

        return Lars(params, lr=lr, momentum=0.9, weight_decay=weight_decay)
    return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)


def fit_probe(train_x: torch.Tensor, train_y: torch.Tensor, num_classes: int, cfg: ProbeConfig,
              public_x: torch.Tensor | None = None, desc: str = "probe") -> tuple[LinearProbe, dict[str, Any]]:
    """Train a head on fixed features. With ``cfg.epsilon``: DP-SGD (Opacus) on the linear
    layer, BatchNorm fixed to ``public_x`` statistics. Returns the head (eval mode) and the
    DP parameters used (empty without DP)."""
    torch.manual_seed(cfg.seed)
    head = LinearProbe(train_x.shape[1], num_classes)
    n = len(train_x)
    batch = min(cfg.batch_size, n)
    steps_per_epoch = math.ceil(n / batch)
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
                for group in opt.param_groups:
                    group["lr"] = cfg.lr * lr_factor(step, warmup, total)
                loss = loss_fn(head(train_x[idx]), train_y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
                bar.update(1)
    else:
        dp = _fit_dp(head, train_x, train_y, cfg, public_x, batch, steps_per_epoch, bar)
    bar.close()
    return head.eval(), dp


def _fit_dp(head: LinearProbe, x: torch.Tensor, y: torch.Tensor, cfg: ProbeConfig, public_x: torch.Tensor | None,
            batch: int, steps_per_epoch: int, bar: tqdm) -> dict[str, Any]:
    import warnings

    from opacus import PrivacyEngine

    if public_x is None:
        raise ConfigError("a DP head needs public features to fix its normalisation")
    with torch.no_grad():
        head.norm.running_mean.copy_(public_x.mean(0))
        head.norm.running_var.copy_(public_x.var(0, unbiased=False))
    head.norm.eval()
    normed = head.norm(x).detach()
    n = len(x)
    q = 1.0 / steps_per_epoch  # Opacus' Poisson loader: expected batch n / len(loader)
    steps = cfg.epochs * steps_per_epoch
    delta = cfg.delta if cfg.delta is not None else default_delta(n)
    kind = Accountant(cfg.accountant)
    sigma = calibrate(cfg.epsilon, delta, q, steps, kind)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(normed, y), batch_size=batch,
                                         generator=torch.Generator().manual_seed(cfg.seed))
    engine = PrivacyEngine(accountant="rdp")  # keeps the step history; the claim is ours (any accountant)
    warnings.filterwarnings("ignore", module="opacus")  # secure-RNG and hook notices, per run
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    linear, opt, loader = engine.make_private(
        module=head.linear, optimizer=torch.optim.SGD(head.linear.parameters(), lr=cfg.lr, momentum=0.9),
        data_loader=loader, noise_multiplier=sigma, max_grad_norm=cfg.max_grad_norm, poisson_sampling=True,
    )
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    step, warmup = 0, cfg.warmup_epochs * steps_per_epoch
    for _ in range(cfg.epochs):
        for xb, yb in loader:
            for group in opt.param_groups:
                group["lr"] = cfg.lr * lr_factor(step, warmup, steps)
            opt.zero_grad()
            if len(xb):
                loss_fn(linear(xb), yb).backward()
            opt.step()  # an empty Poisson sample still takes a noisy step
            step += 1
            bar.update(1)
    if engine.accountant.history != [(sigma, q, steps)]:
        raise RuntimeError(f"accountant history {engine.accountant.history} != {steps} steps at ({sigma}, {q})")
    head.linear = linear._module if hasattr(linear, "_module") else linear
    return {"sigma": sigma, "sample_rate": q, "steps": steps, "delta": delta, "accountant": kind}


@torch.no_grad()
def accuracy(head: LinearProbe, x: torch.Tensor, y: torch.Tensor) -> float:
    return float((head.eval()(x).argmax(1) == y).float().mean()) if len(y) else float("nan")


def run_probe(cfg: ProbeConfig) -> ProbeResult:
    """Extract features, fit the head, evaluate, and (with ``cfg.export``) add it to the repo."""
    head_component(cfg.head)  # validate the name before any work
    encoder = load_encoder(cfg.encoder, device=cfg.device)
    train = load_labelled(cfg.data, cfg.dataset_name)
    if cfg.test_data:
        test = load_labelled(cfg.test_data)
        if test.classes != train.classes:
            raise DataError(f"test classes {test.classes} differ from training classes {train.classes}")
        tr_idx, test_images, test_y = np.arange(len(train.labels)), test.images, test.labels
    else:
        tr_idx, te_idx = _split(train.labels, cfg.test_fraction, cfg.seed)
        test_images, test_y = [train.images[i] for i in te_idx], train.labels[te_idx]
    if cfg.few_shot:
        tr_idx = tr_idx[_few_shot(train.labels[tr_idx], cfg.few_shot, cfg.seed)]
    pooling = cfg.pooling
    train_x = encoder.embed([train.images[i] for i in tr_idx], pooling)
    test_x = encoder.embed(test_images, pooling)
    train_y, test_t = torch.as_tensor(train.labels[tr_idx]), torch.as_tensor(test_y)
    public_x = None
    if cfg.epsilon is not None:
        synth = SyntheticImages(encoder.spec.img_size, seed=1)
        public_x = encoder.embed(torch.stack([synth[i] for i in range(256)]), pooling)
    head, dp = fit_probe(train_x, train_y, len(train.classes), cfg, public_x, desc=f"probe {cfg.head}")
    top1 = accuracy(head, test_x, test_t)
    # The head's stage covers exactly the examples it trained on.
    used = train.dataset if len(tr_idx) == len(train.labels) else Dataset(
        name=train.dataset.name + (f"-{cfg.few_shot}shot" if cfg.few_shot else "-train"),
        size=len(tr_idx), fingerprint=train.dataset.fingerprint,
        description=f"{len(tr_idx)} of the {len(train.labels)} labelled images (split seed {cfg.seed})")
    stage = _stage(cfg, used, dp)
    repo = _export(cfg, encoder, head, train.classes, stage, top1, len(tr_idx), len(test_y)) if cfg.export else None
    features = {"train_x": train_x, "train_y": train_y, "test_x": test_x, "test_y": test_t}
    return ProbeResult(top1, len(tr_idx), len(test_y), head, stage, repo, features)


def _stage(cfg: ProbeConfig, data: Dataset, dp: dict[str, Any]) -> NonPrivateStage | DPStage:
    component = head_component(cfg.head)
    protocol = f"{cfg.pooling} features, BatchNorm + linear, {cfg.epochs} epochs"
    if not dp:
        return NonPrivateStage(
            name=f"linear-probe:{cfg.head}", component=component, dataset=data, private_data=True,
            description=f"linear probe ({protocol}, {cfg.optimizer}) trained without DP: its "
                        "labelled data has no privacy guarantee")
    return DPStage.from_parameters(
        name=f"linear-probe-dp:{cfg.head}", component=component, dataset=data, mechanism="DP-SGD",
        sample_rate=dp["sample_rate"], noise_multiplier=dp["sigma"], steps=dp["steps"],
        clipping_norm=cfg.max_grad_norm, delta=dp["delta"], accountant=dp["accountant"],
        description=f"linear probe ({protocol}) trained with DP-SGD (Opacus); normalisation "
                    "fixed to public procedural-image features",
        hyperparameters={"lr": cfg.lr, "epochs": cfg.epochs, "momentum": 0.9, "pooling": cfg.pooling},
    )


def _export(cfg: ProbeConfig, encoder: Any, head: LinearProbe, classes: list[str],
            stage: NonPrivateStage | DPStage, top1: float, n_train: int, n_test: int) -> Path:
    src = Path(encoder.path)
    if cfg.out:
        out = Path(cfg.out)
        if out.resolve() != src.resolve():
            if out.exists():
                raise ConfigError(f"{out} exists; give the encoder folder itself or a new --out")
            shutil.copytree(src, out)
    elif Path(cfg.encoder).is_dir():
        out = src
    else:
        raise ConfigError("the encoder came from a hub: pass --out DIR to write a repo folder with the head")
    dp_note = f", DP epsilon {stage.epsilon:.3g}" if isinstance(stage, DPStage) else ", no DP"
    metrics = {"top1": top1, "train_size": n_train, "test_size": n_test, "pooling": cfg.pooling,
               "few_shot": cfg.few_shot, "epochs": cfg.epochs}
    result = EvalResult(
        task_type="image-classification", dataset_type=stage.dataset.name, dataset_name=stage.dataset.name,
        metric_type="accuracy", metric_value=round(top1, 4),
        metric_name=f"top-1, linear probe '{cfg.head}' ({cfg.pooling} features{dp_note})",
    )
    save_head(out, head, HeadInfo(cfg.head, cfg.pooling, classes, metrics), stage, result)  # type: ignore[arg-type]
    return out
