"""What a DP fine-tuning step's noise leaves of its signal (issue 56): on public labelled records,
the per-example gradients of a released DP fine-tuning (``vip-hub train-finetune``, the
benchmark's finetune row) clipped as its stage clipped them (``PerExampleClipper``), their mean's
norm, split between the encoder's coordinates and the head's, against the norm of the Gaussian
noise its stage added to that mean (the stage's noise_std sqrt(d) / B, from the repo's ledger; d
the coordinates measured, which for the stage's own head rule are its noised ones less the
audit's canaries).

    python benchmarks/step_signal.py REPO [--records 2000] [--fixed-head | --trained-head]

The model is the released one, its trainable coordinates the stage's (``encoder_parameters``,
``fixed_head``) unless ``--fixed-head`` or ``--trained-head`` says otherwise; the records are the
public Fashion-MNIST test records 0..N-1. A fine-tuning of the whole encoder on unaugmented images
only (``trainable_blocks`` all, ``augmult`` 0: the benchmark's row), whose clipped gradient is
each record's own. Nothing private is read: it measures, it releases nothing.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from training.data.labelled import LabelledArrays, fashion_mnist, head_class_order
from training.dp.clipping import PerExampleClipper
from training.recipes.finetune import STAGE, classifier
from vip_hub.errors import ConfigError
from vip_hub.loading import load_encoder
from vip_hub.privacy.ledger import NOISED_CANARIES, DPStage, PrivacyLedger
from vip_hub.repo.heads import load_head

CHUNK = 250
"""Records per clipper call."""


def step_signal(
    repo: Path, data: LabelledArrays, head: str = "classifier", fixed_head: bool | None = None
) -> dict[str, Any]:
    """The clipped mean gradient of ``repo``'s fine-tuned classifier over ``data`` (its stage's
    clipping norm, trainable coordinates and, unless ``fixed_head`` is given, head rule), its
    norm on the encoder's and on the head's coordinates, and the stage's noise on that mean."""
    stage = PrivacyLedger.read(repo).stage(STAGE)
    if not isinstance(stage, DPStage):
        raise ConfigError(f"{repo}: its {STAGE} stage is not a DP stage")
    hp = stage.hyperparameters
    if hp["trainable_blocks"] != "all" or hp["augmult"]:
        raise ConfigError(
            f"{repo}: a fine-tuning of the top {hp['trainable_blocks']} blocks or with "
            f"{hp['augmult']} views per example; give one of the whole encoder on unaugmented "
            "images (--trainable-blocks all --augmult 0)"
        )
    staged = hp.get("fixed_head", False)  # repos before 2026-11-30 trained their head
    fixed = staged if fixed_head is None else fixed_head
    encoder = load_encoder(repo)
    probe, info = load_head(repo, head)
    target = torch.empty(len(info.labels), dtype=torch.long)  # data's class -> head output
    target[head_class_order(data.classes, info.labels)] = torch.arange(len(info.labels))
    model = classifier(
        encoder,
        len(info.labels),
        info.pooling,
        hp["trainable_blocks"],
        probe,
        parameters=hp["encoder_parameters"],
        train_head=not fixed,
    ).eval()
    clip = stage.clipping_norm
    clipper = PerExampleClipper(model, clip)
    norms = []
    for start in range(0, len(data), CHUNK):
        index = range(start, min(start + CHUNK, len(data)))
        views = torch.stack([encoder.transform(data.pil(i).convert("RGB"))[None] for i in index])
        labels = target[torch.as_tensor(data.labels[list(index)], dtype=torch.long)]
        norms.append(clipper.accumulate(views, labels).norms)
    mean = clipper.take_sum() / len(data)
    head_ids = {id(q) for q in model.head.parameters()}
    in_head = torch.cat([torch.full((p.numel(),), id(p) in head_ids) for p in clipper.params])
    norm = torch.cat(norms)
    noised = stage.noised_dimension - (stage.noised_tensors or {}).get(NOISED_CANARIES, 0)
    if fixed == staged and mean.numel() != noised:
        raise RuntimeError(f"measured {mean.numel()} coordinates, the stage noised {noised}")
    batch = stage.expected_batch_size
    noise = stage.noise_std * math.sqrt(mean.numel()) / batch
    return {
        "records": len(data),
        "fixed_head": fixed,
        "coordinates": {"encoder": int((~in_head).sum()), "head": int(in_head.sum())},
        "clipping_norm": clip,
        "clipped": float((norm > clip).double().mean()),
        "median_norm": float(norm.median()),
        "mean_norm": {
            "all": float(mean.norm()),
            "encoder": float(mean[~in_head].norm()),
            "head": float(mean[in_head].norm()),
        },
        "noise_std": stage.noise_std,
        "expected_batch": batch,
        "noise_norm": noise,
        "signal_to_noise": float(mean.norm()) / noise,
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Command line: print the measurement as JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("repo", type=Path, help="a released DP fine-tuning repo")
    p.add_argument("--records", type=int, default=2000, help="public test records 0..N-1")
    p.add_argument("--head", default="classifier", help="the fine-tuned head's name")
    p.add_argument("--data", default=None, help="Fashion-MNIST folder (default: the package)")
    p.add_argument("--work", default="var/standin", help="where the test split is unpacked")
    rule = p.add_mutually_exclusive_group()
    rule.add_argument("--fixed-head", dest="fixed", action="store_true", default=None)
    rule.add_argument("--trained-head", dest="fixed", action="store_false")
    a = p.parse_args(argv)
    test = fashion_mnist("test", a.data, a.work)
    if not 0 < a.records <= len(test):
        p.error(f"--records {a.records}: give 1 to {len(test)}")
    try:
        out = step_signal(a.repo, test.first(a.records), a.head, a.fixed)
    except ConfigError as e:
        p.error(str(e))
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
