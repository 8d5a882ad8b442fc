"""Per-example gradient clipping without per-example gradients.

``PerExampleClipper.accumulate(batch)`` adds ``sum_i clip(g_i, C)`` to every trainable
parameter's ``.grad``, where ``g_i`` is example i's gradient and
``clip(g, C) = g * min(1, C / ||g||)``. It never holds one full gradient per example:

1. one forward pass hooks every layer: its input activations ``a`` and a gradient hook on
   its output;
2. one backward pass (``torch.autograd.grad`` down to the entry layers' outputs only, so
   autograd skips the weight-gradient products) hands each layer its output gradient ``g``;
3. there and then, each layer's contribution to ``||g_i||^2`` comes from ``(a, g)`` alone
   and only what step 4 needs is kept: for a linear map,
   ``||G_i||^2 = sum_{t,s} (a_t . a_s)(g_t . g_s)`` (the "ghost norm", O(T^2) per example) or
   the materialised per-example product when that is cheaper (O(in * out));
4. the weight gradients are then formed once, from ``a`` or ``g`` (the smaller) scaled per
   example by its clip factor: ``sum_i c_i G_i = (c * g)^T a``, the same product a plain
   backward computes. Small per-example gradients (biases, LayerNorm, tokens) are formed
   once, used for the norms and then summed with the clip factors.

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

__all__ = ["ClipResult", "PerExampleClipper", "UnsupportedLayerError", "clip_factors"]


class UnsupportedLayerError(TypeError):
    """A trainable parameter has no per-example gradient rule."""


@dataclass
class ClipResult:
    """What one micro-batch contributed."""

    losses: torch.Tensor  # (b,) per-example losses, detached
    norms: torch.Tensor  # (b,) per-example gradient norms before clipping (fp32)
    factors: torch.Tensor  # (b,) clip factors applied (0 for a non-finite norm)


@dataclass
class _Parts:
    """One layer's per-example gradient, in the cheapest form, computed once per micro-batch.

    Small per-example gradients (LayerNorm affine, biases, broadcast tokens, and weights whose
    per-example product is cheaper than the ghost norm) are held materialised, (b, *shape);
    a large weight keeps the tokens ``a`` (b, T, in) and ``g`` (b, T, out) instead, and its
    clipped sum is formed by one product once the clip factors are known.
    """

    materialised: list[tuple[nn.Parameter, torch.Tensor]]
    sq_norms: torch.Tensor  # (b,) this layer's share of the squared per-example norms
    weight: nn.Parameter | None = None
    a: torch.Tensor | None = None  # (b, T, in), the layer's own dtype (bf16 under autocast)
    g: torch.Tensor | None = None  # (b, T, out)


def clip_factors(norms: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Per-example factors ``min(1, C / ||g||)`` that clip each gradient to norm ``max_norm``; 0
    for a non-finite norm (such an example must not decide whether a step happens). Every
    clipper, and the audit's canaries, clip through this one function."""
    factors = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    return torch.where(torch.isfinite(norms), factors, torch.zeros_like(factors))


def _no_autocast(x: torch.Tensor) -> torch.autocast:
    """Norms and sums run in the tensors' own precision (at least fp32), not autocast's."""
    return torch.autocast(x.device.type, enabled=False)


def _fp32(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (norms under bf16/fp16 autocast are computed in fp32)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """(b, ..., d) -> (b, T, d)."""
    return x.reshape(x.shape[0], -1, x.shape[-1])


def _sq(per_example: torch.Tensor) -> torch.Tensor:
    """Squared norms of (b, ...) per-example gradients, (b,)."""
    return per_example.reshape(per_example.shape[0], -1).square().sum(1)


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
        parts: list[_Parts] = []
        targets: list[torch.Tensor] = []  # backward runs from the loss down to these only
        grad_hooks: list[torch.utils.hooks.RemovableHandle] = []
        seen: set[int] = set()

        def when_grad(module: nn.Module | nn.Parameter, a: torch.Tensor | None) -> Callable[[torch.Tensor], None]:
            def hook(g: torch.Tensor) -> None:
                with torch.no_grad(), _no_autocast(g):
                    parts.append(self._parts(module, a, g))
            return hook

        def on_forward(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            if id(module) in seen:
                raise UnsupportedLayerError(
                    f"{type(module).__name__} is called twice in one forward pass; "
                    "per-example norms would miss the cross terms"
                )
            seen.add(id(module))
            if args[0].grad_fn is None:  # an entry layer (on the images): backward stops here
                targets.append(out)
            grad_hooks.append(out.register_hook(when_grad(module, args[0])))

        def on_broadcast(param: nn.Parameter, out: torch.Tensor) -> None:
            targets.append(out)
            grad_hooks.append(out.register_hook(when_grad(param, None)))

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
        # Every layer lies between the loss and an entry layer or a broadcast parameter, so its
        # output's hook sees its gradient; no weight gradient is formed here. Each layer is
        # reduced as soon as its gradient arrives, keeping only what step 4 needs.
        if not targets:
            raise UnsupportedLayerError("no layer with trainable parameters ran on this batch")
        try:
            torch.autograd.grad(losses.sum(), targets, allow_unused=True)
        finally:
            for h in grad_hooks:  # the hooks hold activations: drop them with the graph
                h.remove()
        with torch.no_grad(), _no_autocast(losses):
            sq = torch.zeros(losses.shape[0], device=losses.device, dtype=self.norm_dtype)
            for part in parts:
                sq += part.sq_norms
            norms = sq.sqrt()
            factors = clip_factors(norms, self.max_norm)
            dropped = factors == 0
            dropped = dropped if bool(dropped.any()) else None  # one device sync per micro-batch
            for part in parts:
                self._add_clipped(part, factors, dropped)
        return ClipResult(losses.detach(), norms, factors)

    # ---------------------------------------------------------------- per-layer rules
    @staticmethod
    def _parts(m: nn.Module | nn.Parameter, a_in: torch.Tensor | None, g: torch.Tensor) -> _Parts:
        """Layer ``m``'s per-example gradient (see ``_Parts``) and squared norms, from its
        input ``a_in`` and its output's gradient ``g``."""
        if isinstance(m, nn.Parameter):  # broadcast over the batch: the gradient sums over tokens
            pe = _fp32(_tokens(g)).sum(1)
            return _Parts([(m, pe)], _sq(pe))
        # Tokens (b, T, features) in the tensors' own dtype; all arithmetic in at least fp32.
        g_tok = g.flatten(2).transpose(1, 2) if isinstance(m, nn.Conv2d) else _tokens(g)
        gt = _fp32(g_tok)
        small = [(m.bias, gt.sum(1))] if m.bias is not None else []
        if isinstance(m, nn.LayerNorm):
            xhat = _fp32(_tokens(F.layer_norm(_fp32(a_in), m.normalized_shape, eps=m.eps)))
            small.append((m.weight, (gt * xhat).sum(1)))
            return _Parts(small, sum(_sq(pe) for _, pe in small))
        if isinstance(m, nn.Conv2d):
            a_tok = F.unfold(a_in, m.kernel_size, stride=m.kernel_size).transpose(1, 2)
        else:
            a_tok = _tokens(a_in)
        a = _fp32(a_tok)
        t, i, o = a.shape[1], a.shape[2], gt.shape[2]
        sq = sum((_sq(pe) for _, pe in small), torch.zeros(a.shape[0], device=a.device, dtype=a.dtype))
        if i * o < 2 * t * t:  # the per-example product is cheaper than the ghost norm
            pe = torch.einsum("bto,bti->boi", gt, a)
            small.append((m.weight, pe))
            return _Parts(small, sq + _sq(pe))
        ghost = ((a @ a.transpose(1, 2)) * (gt @ gt.transpose(1, 2))).sum((1, 2))
        return _Parts(small, sq + ghost, m.weight, a_tok, g_tok)

    @staticmethod
    def _add_clipped(part: _Parts, factors: torch.Tensor, dropped: torch.Tensor | None) -> None:
        """Add sum_i factors_i * g_i for each of the layer's parameters into ``.grad``."""
        # ``dropped`` marks non-finite examples: 0 * nan is nan, so zero their values outright.
        for param, pe in part.materialised:
            if dropped is not None:
                pe = torch.where(dropped.view(-1, *[1] * (pe.ndim - 1)), 0.0, pe)
            _add(param, torch.einsum("b,b...->...", factors.to(pe.dtype), pe))
        if part.weight is None:
            return
        # The product runs in the activations' dtype, as a plain backward would (bf16 under
        # autocast on GPU: the tensor cores; fp32 on CPU); the norms above are always fp32.
        dtype = torch.promote_types(part.a.dtype, part.g.dtype)
        a, g = part.a.to(dtype), part.g.to(dtype)
        if dropped is not None:
            a = torch.where(dropped[:, None, None], 0.0, a)
            g = torch.where(dropped[:, None, None], 0.0, g)
        # sum_i c_i g_i^T a_i: scale the smaller side, then one product over all tokens.
        c = factors.to(a.dtype)[:, None, None]
        if a.shape[2] <= g.shape[2]:
            a = a * c
        else:
            g = g * c
        _add(part.weight, g.reshape(-1, g.shape[2]).T @ a.reshape(-1, a.shape[2]))


def _add(param: nn.Parameter, grad: torch.Tensor) -> None:
    """``param.grad += grad`` (``grad`` is a fresh tensor: it may become ``.grad`` itself)."""
    grad = grad.reshape(param.shape).to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad
