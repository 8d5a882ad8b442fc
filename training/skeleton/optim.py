"""AdamW with MAE's parameter groups and a warm-up + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["lr_factor", "make_adamw", "warmup_cosine"]


def make_adamw(
    model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float]
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; biases and norm scales (ndim < 2) get no decay,
    as in the reference (timm's ``param_groups_weight_decay``). Fused: one kernel over all
    parameters (on the CPU 21 ms a step for vip-tiny's MAE against 95 ms for the default)."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim < 2 else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine decay to zero at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def warmup_cosine(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """The ``lr_factor`` schedule as a scheduler (its state goes into checkpoints)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, warmup_steps, total_steps)
    )
