"""Step 2 of the ViP recipe: the MAE of a (Syn)-ViP repo trained with DP-AdamW on private images.

The recipe is a model (the MAE), a per-example loss (its masked reconstruction error) and a
clipper (``PerExampleClipper``); everything private about a step is the DP engine's
(``training/dp/engine.py``). Masks and augmentations are drawn per example from the
(seed, step, index) streams, so nothing depends on the micro-batch split or the number of ranks.

Run it with ``vip-hub train-vip ...`` or, on several processes or GPUs,
``torchrun --nproc_per_node N -m training.recipes.vip ...`` (same arguments).
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import Field

from vip_hub.errors import ConfigError
from vip_hub.repo.card import recipe_line
from vip_hub.repo_format import MAE_DECODER_FILE, WEIGHTS_FILE

from ..data.images import MAE_AUGMENTATION, Augmented, mae_transform, open_images
from ..dp.run import DPRun
from ..dp.sampling import MASKING, init_seed, torch_generator
from ..skeleton.config import DPRunConfig, Recipe, recipe_main, tenth_of_steps_to_1000, with_adamw
from ..skeleton.distributed import Dist
from .mae import (
    decoder_warmup_field,
    eval_loss,
    load_mae,
    masked_loss,
    public_eval_batch,
    warm_fresh_decoder,
)
from .trainable import (
    EncoderParameters,
    encoder_parameters_field,
    encoder_parameters_note,
    restrict_encoder,
)

__all__ = ["RECIPE", "VipConfig", "train_vip"]


class VipConfig(
    # a base made at run time (with_adamw's AdamW fields), which mypy takes as Any
    with_adamw(DPRunConfig, lr=3.84e-4, warmup=tenth_of_steps_to_1000, weight_decay=0.005)  # type: ignore[misc]
):
    """A ViP run: DP-AdamW on the MAE loss. Defaults follow the ViP paper, App. A.2."""

    init: str = Field(
        description=f"(Syn)-ViP repo folder or hub id to start from (with {MAE_DECODER_FILE})"
    )
    data: str = Field(
        description="image folder (class subfolders allowed) or directory of webdataset tar shards"
    )
    decoder_dim: int | None = Field(
        None,
        gt=0,
        description="a fresh MAE decoder's width, if the init has none (default: the "
        "family's, as for the next two)",
    )
    decoder_depth: int | None = Field(None, gt=0, description="a fresh MAE decoder's blocks")
    decoder_heads: int | None = Field(None, gt=0, description="a fresh MAE decoder's heads")
    decoder_warmup: int = decoder_warmup_field("MAE decoder")
    encoder_parameters: EncoderParameters = encoder_parameters_field()


def train_vip(cfg: VipConfig, dist: Dist | None = None) -> Path:
    """Run (or resume) DP-AdamW training of an MAE and export the released repo; returns its
    path."""
    dist = dist or Dist.from_env(cfg.device)
    images = open_images(cfg.data)
    n = len(images)
    run = DPRun(cfg, dist, n)
    torch.manual_seed(init_seed(run.seed))  # a fresh decoder, if the init has none: every rank's
    shape = {"dim": cfg.decoder_dim, "depth": cfg.decoder_depth, "num_heads": cfg.decoder_heads}
    mae, init = load_mae(cfg.init, {k: v for k, v in shape.items() if v is not None})
    run.from_init(init)
    spec = init.spec
    mae.to(dist.device)
    transform = mae_transform(mae.encoder, spec.img_size)
    if cfg.decoder_warmup and (Path(init.path) / MAE_DECODER_FILE).is_file():
        raise ConfigError(
            f"--decoder-warmup trains a fresh decoder, and {cfg.init} has one ({MAE_DECODER_FILE})"
        )
    warm_fresh_decoder(
        run, mae, mae.encoder, transform, masked_loss(mae), cfg.decoder_warmup, "decoder"
    )
    trained = restrict_encoder(mae.encoder, cfg.encoder_parameters)
    engine = run.engine(mae)
    augmented = Augmented(images, transform, run.seed)

    def load(index: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.rand(
            mae.num_patches, generator=torch_generator(run.seed, MASKING, step, index)
        )
        return augmented[index, step], noise

    public = public_eval_batch(spec, mae.num_patches)
    records = engine.train(
        run,
        mae,
        load,
        desc="train-vip",
        evaluate=lambda: {"public_loss": eval_loss(mae, public, dist.device)},
    )

    return run.export_dp(
        mae.encoder,
        spec,
        init,
        released={WEIGHTS_FILE: mae.encoder, MAE_DECODER_FILE: mae},
        records=records,
        curve_label="MAE loss on public procedural images",
        dataset_description=f"{n} images; MAE pretraining with DP-AdamW",
        summary=(
            f"A {spec.arch} encoder trained with the ViP recipe: from {cfg.init}, made by "
            f"{recipe_line(init.ledger)}, then MAE training with DP-AdamW on "
            f"{cfg.dataset_name} ({n} images). The loss curve is measured on public procedural "
            "images, so publishing it costs no privacy."
        ),
        files={"decoder": mae.decoder_state_dict(), "decoder_config": mae.config.to_dict()},
        name="dp-pretrain",
        description=(
            "ViP step 2: masked-autoencoder training with DP-AdamW (per-example clipping, "
            "Gaussian noise once per logical step, Poisson sampling)"
            + (
                f"; its fresh decoder first trained {cfg.decoder_warmup} steps on public "
                "procedural images, the encoder frozen (no private data)"
                if cfg.decoder_warmup
                else ""
            )
            + encoder_parameters_note(cfg.encoder_parameters)
        ),
        hyperparameters={
            **cfg.adamw_hyperparameters(),
            "mask_ratio": mae.config.mask_ratio,
            "img_size": spec.img_size,
            "augmentation": MAE_AUGMENTATION,
            "decoder_warmup": cfg.decoder_warmup,
            "encoder_parameters": cfg.encoder_parameters,
            "encoder_trainable_parameters": trained,
        },
    )


RECIPE = Recipe(VipConfig, train_vip)

if __name__ == "__main__":
    raise SystemExit(recipe_main("train-vip"))
