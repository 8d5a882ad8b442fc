"""Per-example gradient clipping without per-example gradients.

``PerExampleClipper.accumulate(batch)`` adds ``sum_i clip(g_i, C)`` to every trainable
parameter's ``.grad``, where ``g_i`` is example i's gradient and
``clip(g, C) = g * min(1, C / ||g||)``. It never holds one full gradient per example:

1. one forward pass records, for every layer, its input activations ``a`` and its output;
2. one backward pass (``torch.autograd.grad`` w.r.t. the layer outputs only, so autograd
   skips the weight-gradient products) gives the output gradients ``g``;
3. each layer's contribution to ``||g_i||^2`` comes from ``(a, g)`` alone: for a linear map,
   ``||G_i||^2 = sum_{t,s} (a_t . a_s)(g_t . g_s)`` (the "ghost norm", O(T^2) per example) or
   the materialised per-example product when that is cheaper (O(in * out));
4. the weight gradients are then formed once, from ``g`` scaled per example by its clip
   factor: ``sum_i c_i G_i = (c * g)^T a``, the same product a plain backward computes.

This is book-keeping ghost clipping (Bu et al. 2023) written for our modules. Supported
layers: ``nn.Linear``, ``nn.LayerNorm``, patchifying ``nn.Conv2d`` (kernel == stride), and
parameters a model broadcasts over the batch itself (the class and mask tokens), which it
announces through ``broadcast_parameters()`` and ``broadcast_hooks``. Any other trainable
parameter is an error at construction: there is no silent fallback to a slow path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ClipResult", "PerExampleClipper", "UnsupportedLayerError"]


class UnsupportedLayerError(TypeError):
    """A trainable parameter has no per-example gradient rule."""


@dataclass
class ClipResult:
    """What one micro-batch contributed."""

    losses: torch.Tensor  # (b,) per-example losses, detached
    norms: torch.Tensor  # (b,) per-example gradient norms before clipping (fp32)
    factors: torch.Tensor  # (b,) clip factors applied (0 for a non-finite norm)


@dataclass
class _Record:
    module: nn.Module | nn.Parameter
    a: torch.Tensor | None  # layer input (None for broadcast parameters)
    out: torch.Tensor


def _fp32(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (norms under bf16/fp16 autocast are computed in fp32)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _as_tokens(x: torch.Tensor) -> torch.Tensor:
    """(b, ..., d) -> (b, T, d), at least fp32."""
    return _fp32(x.reshape(x.shape[0], -1, x.shape[-1]))


def _linear_sq_norms(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per-example squared Frobenius norms of sum_t g_t a_t^T, the cheaper way."""
    t, i, o = a.shape[1], a.shape[2], g.shape[2]
    if 2 * t * t <= i * o:
        return ((a @ a.transpose(1, 2)) * (g @ g.transpose(1, 2))).sum((1, 2))
    return torch.einsum("bto,bti->boi", g, a).square().sum((1, 2))


class PerExampleClipper:
    """Adds the sum of per-example clipped gradients of ``model`` into ``.grad``.

    ``model(*inputs)`` must return per-example losses of shape (b,) where example i's loss
    depends on example i only (no batch statistics).
    """

    def __init__(self, model: nn.Module, max_norm: float):
        if not max_norm > 0:
            raise ValueError(f"clipping norm must be positive, got {max_norm}")
        self.model = model
        self.max_norm = float(max_norm)
        self.layers: list[nn.Module] = []
        covered: set[int] = set()
        broadcast = list(getattr(model, "broadcast_parameters", lambda: [])())
        covered.update(id(p) for p in broadcast)
        for module in model.modules():
            own = [p for p in module.parameters(recurse=False) if p.requires_grad]
            if not own or any(id(p) in covered for p in own):
                continue
            self._check_supported(module)
            self.layers.append(module)
            covered.update(id(p) for p in own)
        missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in covered]
        if missing:
            raise UnsupportedLayerError(
                f"no per-example gradient rule for parameters {', '.join(missing)}; "
                "supported: nn.Linear, nn.LayerNorm, patchifying nn.Conv2d, broadcast tokens"
            )
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.norm_dtype = torch.float64 if any(p.dtype == torch.float64 for p in self.params) else torch.float32

    @staticmethod
    def _check_supported(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            return
        if isinstance(m, nn.LayerNorm) and m.elementwise_affine:
            return
        if (
            isinstance(m, nn.Conv2d)
            and m.stride == m.kernel_size
            and m.padding in (0, (0, 0))
            and m.dilation == (1, 1)
            and m.groups == 1
        ):
            return
        names = ", ".join(n for n, p in m.named_parameters(recurse=False) if p.requires_grad)
        raise UnsupportedLayerError(
            f"{type(m).__name__} holds trainable parameters ({names}) with no per-example "
            "gradient rule; supported: nn.Linear, nn.LayerNorm, patchifying nn.Conv2d"
        )

    def accumulate(self, *inputs: torch.Tensor) -> ClipResult:
        """Run ``model(*inputs)`` and add the clipped per-example gradient sum into ``.grad``."""
        records: list[_Record] = []
        seen: set[int] = set()

        def on_forward(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            if id(module) in seen:
                raise UnsupportedLayerError(
                    f"{type(module).__name__} is called twice in one forward pass; "
                    "per-example norms would miss the cross terms"
                )
            seen.add(id(module))
            records.append(_Record(module, args[0], out))

        def on_broadcast(param: nn.Parameter, out: torch.Tensor) -> None:
            records.append(_Record(param, None, out))

        handles = [m.register_forward_hook(on_forward) for m in self.layers]
        hooks: list[Callable[..., None]] = getattr(self.model, "broadcast_hooks", [])
        hooks.append(on_broadcast)
        try:
            losses = self.model(*inputs)
        finally:
            for h in handles:
                h.remove()
            hooks.remove(on_broadcast)
        if losses.ndim != 1:
            raise ValueError(f"the model must return per-example losses (b,), got {tuple(losses.shape)}")
        grads = torch.autograd.grad(
            losses.sum(), [r.out for r in records], allow_unused=True, materialize_grads=True
        )
        with torch.no_grad():
            sq = torch.zeros(losses.shape[0], device=losses.device, dtype=self.norm_dtype)
            for r, g in zip(records, grads):
                sq += self._sq_norms(r, g)
            norms = sq.sqrt()
            factors = (self.max_norm / (norms + 1e-6)).clamp(max=1.0)
            # A non-finite norm must not decide whether a step happens: drop that example.
            factors = torch.where(torch.isfinite(norms), factors, torch.zeros_like(factors))
            dropped = factors == 0
            dropped = dropped if bool(dropped.any()) else None  # one device sync per micro-batch
            for r, g in zip(records, grads):
                self._accumulate(r, g, factors, dropped)
        return ClipResult(losses.detach(), norms, factors)

    # ---------------------------------------------------------------- per-layer rules
    @staticmethod
    def _tokens(r: _Record, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(a, g) as (b, T, in) and (b, T, out) fp32, the layer seen as a linear map."""
        m = r.module
        if isinstance(m, nn.Conv2d):
            k = m.kernel_size
            a = F.unfold(_fp32(r.a), k, stride=k).transpose(1, 2)
            return a, _fp32(g.flatten(2).transpose(1, 2))
        if isinstance(m, nn.LayerNorm):
            xhat = F.layer_norm(_fp32(r.a), m.normalized_shape, eps=m.eps)
            return _as_tokens(xhat), _as_tokens(g)
        return _as_tokens(r.a), _as_tokens(g)

    def _sq_norms(self, r: _Record, g: torch.Tensor) -> torch.Tensor:
        if isinstance(r.module, nn.Parameter):
            return _as_tokens(g).sum(1).square().sum(1)
        a, gt = self._tokens(r, g)
        bias = gt.sum(1).square().sum(1) if getattr(r.module, "bias", None) is not None else 0.0
        if isinstance(r.module, nn.LayerNorm):
            return (gt * a).sum(1).square().sum(1) + bias
        return _linear_sq_norms(a, gt) + bias

    @staticmethod
    def _add(param: nn.Parameter, grad: torch.Tensor) -> None:
        grad = grad.reshape(param.shape).to(param.dtype)
        if param.grad is None:
            param.grad = grad.clone()
        else:
            param.grad += grad

    def _accumulate(self, r: _Record, g: torch.Tensor, factors: torch.Tensor,
                    dropped: torch.Tensor | None) -> None:
        # ``dropped`` marks non-finite examples: 0 * nan is nan, so zero their values outright.
        if isinstance(r.module, nn.Parameter):
            gt = _as_tokens(g).sum(1)
            gt = torch.where(dropped[:, None], 0.0, gt) if dropped is not None else gt
            self._add(r.module, torch.einsum("b,bd->d", factors, gt))
            return
        m = r.module
        a, gt = self._tokens(r, g)
        if dropped is not None:
            a = torch.where(dropped[:, None, None], 0.0, a)
            gt = torch.where(dropped[:, None, None], 0.0, gt)
        gt = gt * factors[:, None, None]
        flat_g = gt.reshape(-1, gt.shape[-1])
        if isinstance(m, nn.LayerNorm):
            self._add(m.weight, (flat_g * a.reshape(-1, a.shape[-1])).sum(0))
        else:
            self._add(m.weight, flat_g.T @ a.reshape(-1, a.shape[-1]))
        if m.bias is not None:
            self._add(m.bias, flat_g.sum(0))
