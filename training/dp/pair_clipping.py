"""Per-pair clipping for Logit-DP, and whole-batch clipping for its Naive-DP baseline.

The loss (``docs/logit_dp_sensitivity.md``): two views per image through one model,
L2-normalised embeddings phi_i = e(x_i), psi_j = e(x'_j) (``embed``), cosine similarities
Z = phi psi^T and the symmetric InfoNCE ``symmetric_infonce(Z, tau)``.

``PairClipper`` (Logit-DP, Algorithm 1 of Kong et al.) adds sum_ij lambda_ij Clip_B(grad Z_ij)
into its fp64 ``ClippedSum``, lambda = dL/dZ, without ever forming the n^2 pair gradients:

1. one forward pass over the 2n views records every layer's input ``a`` and output;
2. one batched backward (``torch.func.vmap`` over d cotangents, one per embedding coordinate)
   hands each layer its output Jacobian ``Gamma`` (d, 2n, tokens, out) w.r.t. the normalised
   embeddings as it arrives (``_Tap``); the layer's share of the pair norms is bounded there
   and then in fp64, and ``Gamma`` kept for step 4;
3. grad Z_ij = J_i^T psi_j + J'_j^T phi_i, so a linear layer's share of it is
   sum_t (Gamma_it psi_j) a_it^T + sum_s (Gamma'_js phi_i) a'_js^T, a "2T-token example" whose
   squared norm comes from per-view d x d Grams and one cross term per pair (``_pair_sq``), or,
   when the layer has no more inputs than tokens, from each view's (out, in) products; small
   parameters (biases, LayerNorm, broadcast tokens) are the same sum with one token of input 1;
   pairs are taken in row blocks of about ``pair_block`` elements (memory against time). Each
   view also gets its cross term F_v = sum_t ||Gamma_vt||_F ||a_vt||, and pair (i, j) the bound
   X_ij = F_i + F'_j on what the rounding of its share of step 4's fp64 arithmetic scales with;
4. clip factors c_ij = ``capped_factors`` of the pair norms' upper bounds and X (so that
   c_ij X_ij <= B / kappa); the clipped sum sum_ij w_ij grad Z_ij (w = lambda c) is formed in
   fp64 from the kept Jacobians: each view's cotangent k (k_i = sum_j w_ij psi_j,
   k'_j = sum_i w_ij phi_i), each view's output gradient ``Gamma_v k_v``, then products over at
   most ``PRODUCT_ROWS`` less the depth of those two sums (``product_sum``), never a backward in
   a layer's own precision, whose rounding no pair's clip bounds.

The realised sum then differs from the exact one by at most gamma_{R+1} sum_ij |w_ij| c_ij X_ij
<= gamma_{R+1} (2n / tau) B / kappa, which the ``FP64_CAPPED`` allowance covers (the argument in
``docs/logit_dp_sensitivity.md``). Neither clipped sum is additive over micro-batches:
``accumulate`` takes a step's whole Poisson sample (on this rank) and refuses to run while its
sum holds anything.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from timm.layers import Mlp
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from vip_hub.errors import ConfigError, UnsupportedLayerError
from vip_hub.privacy.sensitivity import (
    PRODUCT_ROWS,
    check_temperature,
    gamma64,
    logit_dp_sensitivity,
)

from .clipping import (
    BroadcastHook,
    ClippedSum,
    ClipResult,
    LayerClipper,
    SumClipper,
    broadcast,
    capped_factors,
    product_sum,
    upper_sq,
)

__all__ = ["BatchClipper", "ContrastiveEmbedder", "PairClipper", "embed", "symmetric_infonce"]

PAIR_BLOCK = 1 << 19
"""``PairClipper``'s default ``pair_block``: per-pair tensors are formed for as many rows i at a
time as keep each under this many elements (2 MiB in fp32; see the benchmarks' README)."""


def symmetric_infonce(z: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per-example losses (n,) of the similarity matrix ``z`` (n, n): the mean of the row's and
    the column's cross-entropy with logits z / tau, the positive on the diagonal."""
    logits = z / temperature
    target = torch.arange(z.shape[0], device=z.device)
    rows = F.cross_entropy(logits, target, reduction="none")
    cols = F.cross_entropy(logits.T, target, reduction="none")
    return (rows + cols) / 2


def embed(model: nn.Module, views1: torch.Tensor, views2: torch.Tensor) -> torch.Tensor:
    """The 2n normalised embeddings [phi; psi] (2n, d): both views in one forward pass."""
    return _embeddings(model, _both_views(views1, views2))


def _both_views(views1: torch.Tensor, views2: torch.Tensor) -> torch.Tensor:
    """The 2n views, first views first; the two must have one shape."""
    if views1.shape != views2.shape:
        raise ValueError(
            f"the two views differ in shape: {tuple(views1.shape)} vs {tuple(views2.shape)}"
        )
    return torch.cat([views1, views2])


def _embeddings(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The normalised embeddings (b, d) of a batch of images."""
    out = model(images)
    if out.ndim != 2:
        raise ValueError(f"the model must return embeddings (b, d), got {tuple(out.shape)}")
    return F.normalize(out.float() if out.dtype in (torch.float16, torch.bfloat16) else out, dim=1)


def _loss_weights(e: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """lambda = dL/dZ (n, n) in fp64 and the per-example losses (n,) in ``e``'s dtype, both
    detached. Z is formed in fp64 and clamped to [-1, 1], where the sensitivity's proof puts it
    (F2): the products of embeddings normalised in fp32 pass 1 by a few units in the last place."""
    n = e.shape[0] // 2
    e64 = e.detach().double()
    z = (e64[:n] @ e64[n:].T).clamp(-1.0, 1.0).requires_grad_(True)
    with torch.enable_grad(), torch.autocast(e.device.type, enabled=False):
        losses = symmetric_infonce(z, temperature)
        (weights,) = torch.autograd.grad(losses.sum(), z)
    return weights, losses.detach().to(e.dtype)


def _require_empty(clipped: ClippedSum) -> None:
    if not clipped.empty:
        raise RuntimeError(
            "a contrastive clipped sum is not additive over micro-batches: give accumulate the "
            "step's whole sample in one call (micro_batch_size=None) and take the sum "
            "(take_sum) between steps"
        )


_REUSE_GRADIENTS: ContextVar[bool] = ContextVar("reuse_gradients", default=False)
"""True inside ``PairClipper``'s batched backward, where GELU may overwrite the gradient it
receives (see ``_GeluGrad.vmap``)."""


class _GeluFunction(torch.autograd.Function):
    """The exact GELU, whose backward is ``_GeluGrad``."""

    generate_vmap_rule = True  # torch.func.vmap over the model (per-example gradients) works

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[torch.Tensor], output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return _GeluGrad.apply(grad, x)


class _GeluGrad(torch.autograd.Function):
    """GELU's backward, aten's ``gelu_backward(grad, x)``; batched over the gradient only (d
    cotangents through one input: ``PairClipper``'s batched backward), the derivative is
    evaluated once and multiplies every cotangent's gradient."""

    @staticmethod
    def forward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.gelu_backward(grad, x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[torch.Tensor, torch.Tensor], output: Any) -> None:
        """Nothing to save: GELU's second derivative is never taken."""

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[int | None, int | None], grad: torch.Tensor, x: torch.Tensor
    ) -> tuple[torch.Tensor, int]:
        grad_dim, x_dim = in_dims
        if x_dim is None and grad_dim is not None:
            # In PairClipper's batched backward the d-fold gradient reaching GELU is the next
            # layer's input gradient, autograd's own buffer, which no clipping rule reads (they
            # read output gradients): it becomes GELU's input gradient in place instead of a
            # second d-fold buffer beside it (the peak). Elsewhere (a caller's cotangents fed
            # straight in) and for an expanded gradient, a new tensor.
            slope = torch.ops.aten.gelu_backward(x.new_ones(()).expand_as(x), x).unsqueeze(grad_dim)
            pairs = zip(grad.stride(), grad.shape, strict=True)
            expanded = any(step == 0 and size > 1 for step, size in pairs)
            reuse = _REUSE_GRADIENTS.get() and not expanded
            return (grad.mul_(slope) if reuse else grad * slope), grad_dim
        grad, x = (
            t.movedim(dim, 0) if dim is not None else t.expand(info.batch_size, *t.shape)
            for t, dim in ((grad, grad_dim), (x, x_dim))
        )
        return torch.ops.aten.gelu_backward(grad, x), 0


class _Gelu(nn.Module):
    """``nn.GELU()`` through ``_GeluFunction``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GeluFunction.apply(x)


class ContrastiveEmbedder(nn.Module):
    """A backbone and a projection head: ``forward(images) -> (b, dim)`` (``embed`` normalises).

    The backbone is a timm model returning pooled features (``num_classes=0``). A
    ``VisionTransformer``'s class token and trainable position embedding are broadcast here and
    announced through ``broadcast_parameters()`` and ``broadcast_hooks``, as
    ``training.recipes.mae.MAE`` does, so that clippers can read their per-example gradients; its
    attention runs unfused (the same function): ``PairClipper``'s batched backward has no batching
    rule for the fused kernel and would fall back to a slow loop. The exact GELUs of timm ``Mlp``
    blocks and of the head, whose output feeds one linear layer alone, become ``_Gelu`` (the same
    function), whose backward evaluates the derivative once where aten's evaluates it, and holds the
    input, once per cotangent of that batched backward, and overwrites the gradient it receives
    there (a GELU whose output also fed a residual sum would share that gradient with the other
    branch).
    """

    def __init__(self, encoder: nn.Module, dim: int = 128, hidden: int | None = None):
        super().__init__()
        features = int(cast(int, encoder.num_features))  # a timm backbone's width
        hidden = hidden or features
        self.encoder = encoder
        self.head = nn.Sequential(nn.Linear(features, hidden), nn.GELU(), nn.Linear(hidden, dim))
        self.broadcast_hooks: list[BroadcastHook] = []
        if isinstance(encoder, VisionTransformer) and (
            encoder.reg_token is not None
            or encoder.no_embed_class
            or encoder.dynamic_img_size
            or encoder.pos_embed is None
            or encoder.attn_pool is not None
        ):
            raise UnsupportedLayerError(
                "ContrastiveEmbedder supports ViTs with an optional class token, a "
                "position embedding over all tokens and no register tokens or attention pool"
            )
        for module in self.modules():
            if hasattr(module, "fused_attn"):
                # timm attention's bool flag (nn.Module types an unknown attribute as a module)
                module.fused_attn = False  # type: ignore[assignment]
            if not (isinstance(module, Mlp) or module is self.head):
                continue  # only where a GELU's output feeds one linear layer (_GeluGrad.vmap)
            for name, child in module.named_children():
                if type(child) is nn.GELU and child.approximate == "none":
                    setattr(module, name, _Gelu())

    def broadcast_parameters(self) -> list[nn.Parameter]:
        """Parameters this module broadcasts over the batch itself (see ``broadcast_hooks``)."""
        enc = self.encoder
        if not isinstance(enc, VisionTransformer):
            return []
        return [p for p in (enc.cls_token, enc.pos_embed) if p is not None and p.requires_grad]

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        enc = self.encoder
        if not isinstance(enc, VisionTransformer):
            return self.head(enc(images))
        x = enc.patch_embed(images)
        if enc.cls_token is not None:
            token = broadcast(enc.cls_token, (len(x), 1, -1), self.broadcast_hooks)
            x = torch.cat([token, x], dim=1)
        assert enc.pos_embed is not None  # __init__ refuses a ViT without one
        x = enc.pos_drop(x + broadcast(enc.pos_embed, tuple(x.shape), self.broadcast_hooks))
        x = enc.norm(enc.blocks(enc.norm_pre(enc.patch_drop(x))))
        return self.head(enc.forward_head(x, pre_logits=True))


@dataclass
class _Record:
    """One layer (or broadcast parameter) met in the forward pass: its input and output,
    whether the backward stops there (its input needs no gradient), and a LayerNorm's
    normalised input once computed."""

    owner: nn.Module | nn.Parameter
    a: torch.Tensor | None
    out: torch.Tensor
    entry: bool
    xhat: torch.Tensor | None = None


class _Tap(torch.autograd.Function):
    """Identity on a gradient. Applied to a gradient inside ``torch.func.vmap`` (the batched
    backward), its vmap rule sees the whole tensor, cotangents first, and hands it to ``fn``."""

    @staticmethod
    def forward(g: torch.Tensor, fn: Callable[[torch.Tensor], None]) -> torch.Tensor:
        return g

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        """Nothing to save: the tap is never differentiated."""

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple[int | None, None], g: torch.Tensor, fn: Callable[..., None]
    ) -> tuple[torch.Tensor, int | None]:
        dim = in_dims[0]
        fn(g.expand(info.batch_size, *g.shape) if dim is None else g.movedim(dim, 0))
        return g, dim


class PairClipper(LayerClipper):
    """Logit-DP: adds sum_ij lambda_ij Clip_B(grad Z_ij) of ``model`` into its fp64 sum.

    ``model(images)`` returns (b, d) embeddings, each depending on its own image only (no batch
    statistics). With ``max_batch`` m, a batch of more than m examples adds nothing (the
    mechanism whose sensitivity ``logit_dp_sensitivity(B, tau, m)`` is). Supported trainable
    layers: ``nn.Linear``, ``nn.Conv2d`` (groups 1, zero padding), ``nn.LayerNorm`` over the last
    dimension, and parameters the model broadcasts itself (``broadcast_parameters``).
    ``pair_block``: elements per block of per-pair tensors (smaller: less memory, more time).
    """

    def __init__(
        self,
        model: nn.Module,
        max_norm: float,
        temperature: float,
        max_batch: int | None = None,
        pair_block: int = PAIR_BLOCK,
    ):
        if pair_block < 1:
            raise ConfigError(f"pair_block must be positive, got {pair_block}")
        super().__init__(model, max_norm)
        logit_dp_sensitivity(max_norm, temperature, max_batch)  # tau and m, as verify checks them
        self.temperature, self.max_batch = float(temperature), max_batch
        self.pair_block = pair_block

    @staticmethod
    def _check_supported(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            return
        if isinstance(m, nn.LayerNorm) and len(m.normalized_shape) == 1:
            return
        if (
            isinstance(m, nn.Conv2d)
            and m.groups == 1
            and m.padding_mode == "zeros"
            and isinstance(m.padding, tuple)
        ):
            return
        raise UnsupportedLayerError(
            f"{type(m).__name__} holds trainable parameters with no per-pair rule; supported: "
            "nn.Linear, nn.Conv2d (groups 1, zero padding), nn.LayerNorm (last dim), broadcast "
            "parameters"
        )

    def accumulate(self, views1: torch.Tensor, views2: torch.Tensor) -> ClipResult:
        """Add the Logit-DP clipped sum of this batch into the sum. Returns the per-example
        losses (n,), upper bounds on the pair norms ||grad Z_ij|| (n, n) and the factors applied
        (n, n)."""
        _require_empty(self.sum)
        n = views1.shape[0]
        if self.max_batch is not None and n > self.max_batch:  # the capped mechanism adds nothing
            with torch.no_grad():
                _, losses = _loss_weights(embed(self.model, views1, views2), self.temperature)
            full = torch.full((n, n), float("nan"), device=losses.device, dtype=torch.float64)
            return ClipResult(losses, full, torch.zeros_like(full))
        records, e = self._forward(_both_views(views1, views2))
        with torch.no_grad():
            phi, psi = e[:n].detach().double(), e[n:].detach().double()
        shares, kept, finite = self._jacobian_pass(e, records, phi, psi)
        del records
        bad = ~(finite[:n] & finite[n:])
        if bool(bad.any()):  # decided per example: the others' clipped sum is the batch without it
            del kept, e, shares
            return self._without(bad, views1, views2)
        with torch.no_grad(), torch.autocast(e.device.type, enabled=False):
            zeros = torch.zeros(n, n, device=e.device, dtype=torch.float64)
            sq = sum((share for share, _, _ in shares), zeros)
            views = sum((f for _, f, _ in shares), torch.zeros(2 * n, device=e.device))
            cross = views[:n, None] + views[None, n:]  # X_ij = F_i + F'_j
            depth = max(d for _, _, d in shares) + len(shares) + n  # the layers' shares, summed
            sq = sq.clamp(min=0) + 4 * gamma64(depth) * cross.square()
            factors = capped_factors(sq, cross, self.max_norm)
            del shares
            weights, losses = _loss_weights(e, self.temperature)
            w = weights * factors
            k = torch.cat([w @ psi, w.T @ phi])  # each view's cotangent: d(sum_ij w_ij Z_ij)/de
            rows = PRODUCT_ROWS - n - e.shape[1] - 2  # the depth of k and of Gamma k, then rows
            while kept:  # each record's Jacobian goes as soon as its sum is added
                record, jac = kept.pop()
                grad_out = torch.einsum("av...,va->v...", jac.double(), k)
                self._add_clipped(record, grad_out, rows)
        return ClipResult(losses, sq.sqrt(), factors)

    def _forward(self, images: torch.Tensor) -> tuple[list[_Record], torch.Tensor]:
        """The normalised embeddings of ``images`` and the records of the layers that made them."""
        records: list[_Record] = []

        def on_forward(module: nn.Module, a: torch.Tensor, out: torch.Tensor) -> None:
            records.append(_Record(module, a.detach(), out, a.grad_fn is None))

        def on_broadcast(param: nn.Parameter, out: torch.Tensor) -> None:
            records.append(_Record(param, None, out, True))

        with self._hooked(on_forward, on_broadcast):
            e = _embeddings(self.model, images)
        return records, e

    def _jacobian_pass(
        self, e: torch.Tensor, records: list[_Record], phi: torch.Tensor, psi: torch.Tensor
    ) -> tuple[
        list[tuple[torch.Tensor, torch.Tensor, int]],
        list[tuple[_Record, torch.Tensor]],
        torch.Tensor,
    ]:
        """One batched backward of the d cotangents (one per embedding coordinate) from ``e``, the
        embeddings of the first views (``phi``) then the second (``psi``), down to the records:
        each record's Jacobian (d, views, *out.shape[1:]) is reduced to its share of the pair
        norms and its views' cross terms (``_pair_share``) as it arrives, and kept. Returns the
        shares, the kept (record, Jacobian) and (views,) whether each view's embedding,
        activations and Jacobians sum to a finite number (a function of the example alone, like
        everything that decides its pairs)."""
        shares: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        kept: list[tuple[_Record, torch.Tensor]] = []
        sums = [e.detach().sum(1)]

        def reduce(record: _Record) -> Callable[[torch.Tensor], None]:
            def fn(jac: torch.Tensor) -> None:
                with torch.no_grad(), torch.autocast(jac.device.type, enabled=False):
                    sums.append(jac.sum([k for k in range(jac.ndim) if k != 1]))
                    if record.a is not None:
                        sums.append(record.a.flatten(1).sum(1))
                    shares.append(self._pair_share(record, jac.double(), phi, psi))
                    kept.append((record, jac))

            return lambda g: _Tap.apply(g, fn)

        handles = [r.out.register_hook(reduce(r)) for r in records]
        targets = [r.out for r in records if r.entry]
        d = e.shape[1]
        basis = torch.eye(d, device=e.device, dtype=e.dtype)[:, None, :].expand(d, *e.shape)

        def backward(cotangent: torch.Tensor) -> list[torch.Tensor]:
            grads = torch.autograd.grad(e, targets, cotangent, allow_unused=True)
            return [g for g in grads if g is not None]

        reuse = _REUSE_GRADIENTS.set(True)
        try:
            torch.func.vmap(backward)(basis)
        finally:
            _REUSE_GRADIENTS.reset(reuse)
            for h in handles:
                h.remove()
        if len(shares) != len(records):
            raise UnsupportedLayerError(
                f"{len(records) - len(shares)} recorded layer outputs got no gradient from the "
                "embeddings: every layer with trainable parameters must feed them"
            )
        total = cast(torch.Tensor, sum(x.double() for x in sums))  # sums is never empty
        return shares, kept, torch.isfinite(total)

    def _without(self, bad: torch.Tensor, views1: torch.Tensor, views2: torch.Tensor) -> ClipResult:
        n, keep = bad.shape[0], (~bad).nonzero().squeeze(1)
        nan = torch.full((n, n), float("nan"), device=bad.device, dtype=torch.float64)
        losses, norms, factors = nan[0].clone(), nan.clone(), torch.zeros_like(nan)
        if keep.numel():
            sub = self.accumulate(views1[keep], views2[keep])
            losses[keep] = sub.losses.to(losses.dtype)
            rows = keep[:, None]
            norms[rows, keep], factors[rows, keep] = sub.norms, sub.factors
        return ClipResult(losses, norms, factors)

    # ------------------------------------------------------------------ per-layer rules
    def _pair_share(
        self, record: _Record, jac: torch.Tensor, phi: torch.Tensor, psi: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """This record's share of ||grad Z_ij||^2 (n, n) from its input and fp64 output Jacobian,
        its views' cross terms F_v = sum_t ||Gamma_vt||_F ||a_vt|| (views,), raised by the
        rounding of their own evaluation, and the most roundings a term of that share passed
        through (``_pair_sq``)."""
        m, block, d = record.owner, self.pair_block, jac.shape[0]
        if isinstance(m, nn.Parameter):
            g = _broadcast_jacobian(m, record.out, jac)[:, :, None]
            depth = _sq_depth(1, 1, g.shape[3], d)
            return _pair_sq(None, g, phi, psi, block), _view_cross(None, g), depth
        m = cast("nn.Linear | nn.LayerNorm | nn.Conv2d", m)  # what _check_supported admits
        g = _tokens(m, jac, 2)
        t, o = g.shape[2], g.shape[3]
        small = []  # per-view Jacobians (d, 2n, numel) of the bias and a LayerNorm's weight
        cross = torch.zeros(g.shape[1], device=g.device, dtype=torch.float64)
        if m.bias is not None and m.bias.requires_grad:
            small.append(g.sum(2))
            cross += _view_cross(None, g)
        if isinstance(m, nn.LayerNorm):
            if m.weight is not None and m.weight.requires_grad:
                xhat = self._normalised(record).reshape(g.shape[1:])
                small.append((g * xhat).sum(2))
                cross += _view_cross(xhat, g)
            sq = _pair_sq(None, torch.cat(small, 2)[:, :, None], phi, psi, block)
            return sq, cross, t + _sq_depth(1, 1, 2 * o, d)
        # 0 (an int) only until the weight's products are added: without a trained bias or
        # LayerNorm weight, the layer trains its weight
        sq = _pair_sq(None, torch.cat(small, 2)[:, :, None], phi, psi, block) if small else 0  # type: ignore[assignment]
        depth = t + _sq_depth(1, 1, o, d)
        if not m.weight.requires_grad:
            return sq, cross, depth
        a = self._inputs(record).double()
        i = a.shape[2]
        if i <= t:  # no more inputs than tokens: each view's (out, in) products
            sq = sq + _pair_sq(
                None, (g.transpose(2, 3) @ a).flatten(2)[:, :, None], phi, psi, block
            )
            depth = max(depth, t + _sq_depth(1, 1, o * i, d))
        else:
            sq = sq + _pair_sq(a, g, phi, psi, block)
            depth = max(depth, _sq_depth(i, t, o, d))
        return sq, cross + _view_cross(a, g), depth

    def _add_clipped(self, record: _Record, grad_out: torch.Tensor, rows: int) -> None:
        """Add the record's parameters' clipped sums into the sum from its fp64 output gradient
        ``grad_out`` (2n, *out.shape[1:]), what a backward of sum_ij w_ij Z_ij would hand it, in
        fp64 products of at most ``rows`` rows."""
        m = record.owner
        if isinstance(m, nn.Parameter):
            self.sum.add(m, grad_out.sum([0, *_expanded_dims(m, record.out)], keepdim=True))
            return
        m = cast("nn.Linear | nn.LayerNorm | nn.Conv2d", m)  # what _check_supported admits
        g = _tokens(m, grad_out, 1)
        ones = torch.ones(g.shape[0], device=g.device, dtype=torch.float64)
        if m.bias is not None and m.bias.requires_grad:
            self.sum.add(m.bias, g.flatten(0, 1).sum(0))
        if isinstance(m, nn.LayerNorm):
            if m.weight is not None and m.weight.requires_grad:
                xhat = self._normalised(record).reshape(g.shape)
                self.sum.add(m.weight, (g * xhat).flatten(0, 1).sum(0))
            return
        if m.weight.requires_grad:  # products over the views' tokens, in fp64
            total = product_sum(g, self._inputs(record), ones, rows)
            self.sum.add(m.weight, total)

    def _normalised(self, record: _Record) -> torch.Tensor:
        """A LayerNorm's normalised input in fp64, computed once per record (the norms and the
        sum read the same values)."""
        if record.xhat is None:
            m = cast(nn.LayerNorm, record.owner)  # called for a LayerNorm's record
            assert record.a is not None  # a layer's input (None only for a broadcast parameter)
            record.xhat = F.layer_norm(record.a.double(), m.normalized_shape, eps=m.eps)
        return record.xhat

    @staticmethod
    def _inputs(record: _Record) -> torch.Tensor:
        """A linear layer's input tokens, or a convolution's patches, (2n, T, in), as the layer
        multiplied them: in its output's precision (autocast's)."""
        assert record.a is not None  # a layer's input (None only for a broadcast parameter)
        m, a = record.owner, record.a.to(record.out.dtype)
        if isinstance(m, nn.Conv2d):
            padding = cast(tuple[int, ...], m.padding)  # a tuple: _check_supported refuses "same"
            return F.unfold(a, m.kernel_size, m.dilation, padding, m.stride).transpose(1, 2)
        return a.reshape(a.shape[0], -1, a.shape[-1])


def _sq_depth(inputs: int, tokens: int, out: int, d: int) -> int:
    """The most roundings a term of ``_pair_sq``'s evaluation passes through for views of
    ``tokens`` tokens of ``inputs`` inputs and ``out`` outputs, d embedding coordinates: the
    Grams (in + T + T out), their contraction with psi and phi, the cross term's (2 d + 8)."""
    return inputs + tokens + tokens * out + 2 * d + 8


def _view_cross(a: torch.Tensor | None, g: torch.Tensor) -> torch.Tensor:
    """F_v = sum_t ||Gamma_vt||_F ||a_vt|| (views,) in fp64 from inputs ``a`` (views, T, in)
    (None: one of input 1 each) and Jacobians ``g`` (d, views, T, out), raised by the rounding
    of its own evaluation."""
    gamma = g.double().square().sum((0, 3)).sqrt()  # (views, T)
    if a is not None:
        gamma = gamma * a.double().norm(dim=2)
    terms = g.shape[0] * g.shape[3] + (0 if a is None else a.shape[2]) + g.shape[2] + 8
    return gamma.sum(1) * (1 + 2 * gamma64(terms))


def _tokens(m: nn.Module, x: torch.Tensor, lead: int) -> torch.Tensor:
    """A layer's output gradients (``lead`` leading dims, then the output's shape) as tokens of its
    output features: (*lead dims, T, out); a convolution's channels first become last."""
    if isinstance(m, nn.Conv2d):
        return x.flatten(lead + 1).transpose(lead, lead + 1)
    return x.reshape(*x.shape[:lead], -1, x.shape[-1])


def _expanded_dims(param: nn.Parameter, out: torch.Tensor) -> list[int]:
    """The dims of ``out`` a broadcast parameter of size 1 was expanded along (besides the
    batch)."""
    if param.ndim != out.ndim or param.shape[0] != 1:
        raise UnsupportedLayerError(
            f"a broadcast parameter of shape {tuple(param.shape)} must be expanded "
            f"along new leading batch dim 1 only, got {tuple(out.shape)}"
        )
    return [k for k in range(1, param.ndim) if param.shape[k] == 1 and out.shape[k] != 1]


def _broadcast_jacobian(param: nn.Parameter, out: torch.Tensor, jac: torch.Tensor) -> torch.Tensor:
    """(d, 2n, numel): per-view Jacobians of a parameter the model expanded to ``out``."""
    dims = [k + 1 for k in _expanded_dims(param, out)]
    summed = jac.sum(dims, keepdim=True) if dims else jac
    return summed.reshape(jac.shape[0], jac.shape[1], -1)


def _blocks(n: int, per_row: int, block: int) -> list[slice]:
    """Row blocks such that a (rows, per_row) tensor stays under ``block`` elements (one row at
    least)."""
    rows = max(1, block // max(1, per_row))
    return [slice(i, min(i + rows, n)) for i in range(0, n, rows)]


def _pair_sq(
    a: torch.Tensor | None, g: torch.Tensor, phi: torch.Tensor, psi: torch.Tensor, block: int
) -> torch.Tensor:
    """||sum_t u_ijt a_it^T + sum_s v_ijs a'_js^T||^2 (n1, n2), u_ijt = Gamma_it psi_j and
    v_ijs = Gamma'_js phi_i: one parameter's share of ||grad Z_ij||^2, from the views' inputs
    ``a`` (n1 + n2, T, in) (None: one token of input 1, the Jacobian is the parameter's own) and
    Jacobians ``g`` = Gamma (d, n1 + n2, T, out), the n1 = len(phi) first views first.

    The views' own terms come from per-view d x d Grams M_v = sum_{t,t'} (a_t . a_t') Gamma_t^T
    Gamma_t' as psi_j^T M_i psi_j + phi_i^T M'_j phi_i; only the cross term
    2 sum_{t,s} (a_it . a'_js)(u_ijt . v_ijs) = 2 sum_a psi_j^a (Gamma_i^a . Y_ij) with
    Y_ijt = sum_s (a_it . a'_js) v_ijs is formed per pair, in row blocks (u never is)."""
    d, views, t, o = g.shape
    n, m = len(phi), len(psi)
    per_view = g.transpose(0, 1).flatten(2)  # (views, d, T out), a view
    grams = torch.empty(views, d, d, device=g.device, dtype=g.dtype)
    for rows in _blocks(views, d * t * o, block):
        x = per_view[rows]
        if a is not None:
            x = (a[rows] @ a[rows].mT)[:, None] @ x.unflatten(2, (t, o))
        grams[rows] = per_view[rows] @ x.flatten(2).mT
    sq = ((grams[:n] @ psi.T) * psi.T).sum(1) + ((grams[n:] @ phi.T) * phi.T).sum(1).T
    other = g[:, n:].reshape(d, m * t * o)  # Gamma'_j, a view
    tokens = None if a is None else a[n:].reshape(m * t, a.shape[2])
    for rows in _blocks(n, m * t * max(o, t), block):
        y = (phi[rows] @ other).view(-1, m, t, o)  # v_ij
        if a is not None:
            assert tokens is not None  # set with a
            cross = (a[rows].flatten(0, 1) @ tokens.T).view(-1, t, m, t).transpose(1, 2)
            y = cross @ y
        z = per_view[rows] @ y.flatten(2).mT  # (rows, d, n): Gamma_i^a . Y_ij
        sq[rows] += 2 * (z * psi.T).sum(1)
    return sq


class BatchClipper(SumClipper):
    """Naive-DP: adds Clip_C(grad of the batch's summed ``symmetric_infonce``) into its fp64 sum.

    ``model(images)`` returns (b, d) embeddings. The whole-batch gradient is what autograd forms
    (in each layer's precision); its norm is bounded in fp64 from exactly those values, so the
    clipped vector, formed in fp64, is within C whatever that gradient's rounding (proof:
    ``docs/logit_dp_sensitivity.md``). Returns the per-example losses (n,), the bound on the
    whole-batch gradient norm (1,) and the factor applied (1,); 0 (nothing added) when the norm
    is not finite.
    """

    def __init__(self, model: nn.Module, max_norm: float, temperature: float):
        super().__init__(model, max_norm)
        check_temperature(temperature)
        self.temperature = float(temperature)

    def accumulate(self, views1: torch.Tensor, views2: torch.Tensor) -> ClipResult:
        """Add the clipped whole-batch gradient of this batch into the sum."""
        _require_empty(self.sum)
        e = embed(self.model, views1, views2)
        n = views1.shape[0]
        losses = symmetric_infonce(e[:n] @ e[n:].T, self.temperature)
        # None for a parameter the losses do not reach (allow_unused)
        reached = torch.autograd.grad(losses.sum(), self.params, allow_unused=True)
        grads = [
            torch.zeros_like(p) if g is None else g
            for p, g in zip(self.params, reached, strict=True)
        ]
        with torch.no_grad(), torch.autocast(e.device.type, enabled=False):
            terms = sum(g.numel() for g in grads)
            # a tensor: grads holds one per parameter, and a clipper has some
            total = cast(torch.Tensor, sum(g.double().square().sum() for g in grads))
            sq = upper_sq(total, terms)
            norm = sq.sqrt().reshape(1)
            factor = capped_factors(sq.reshape(1), torch.zeros(1, dtype=sq.dtype), self.max_norm)
            # a non-finite gradient adds zeros, not nan * 0
            for p, g in zip(self.params, grads, strict=True):
                self.sum.add(p, torch.where(factor > 0, g.double() * factor, 0.0))
        return ClipResult(losses.detach(), norm, factor)
