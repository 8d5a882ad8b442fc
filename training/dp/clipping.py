"""Per-example gradient clipping without per-example gradients.

``PerExampleClipper.accumulate(*inputs)`` adds ``sum_i clip(g_i, C)`` to every trainable
parameter's ``.grad``, where ``g_i`` is example i's gradient and
``clip(g, C) = g * min(1, C / ||g||)``. It never holds one full gradient per example:

1. one forward pass hooks every layer: its input ``a`` and a gradient hook on its output;
2. one backward pass (``torch.autograd.grad`` down to the entry layers' outputs only, so
   autograd skips the weight-gradient products) hands each layer its output gradient ``g``;
3. there and then, each layer's contribution to ``||g_i||^2`` comes from ``(a, g)`` alone and
   only what step 4 needs is kept. A linear map's per-example weight gradient is
   ``G_i = g_i^T a_i`` over the example's T tokens; its squared norm is the "ghost norm"
   ``sum_{t,s} (a_t . a_s)(g_t . g_s)`` (O(T^2 (in + out)); both Gram matrices are symmetric,
   so for many tokens only their block upper triangle is formed), unless materialising
   ``G_i`` is both cheaper and no larger than the ``a`` and ``g`` the ghost route keeps (see
   ``_materialise``). An embedding's ``G_i`` scatters the rows of ``g`` by token id: its rows
   are summed per (example, id), O(T d), never a table per example;
4. once the clip factors ``c`` are known, each weight's clipped sum is formed once:
   ``sum_i c_i G_i = (c * g)^T a``, the same product a plain backward computes (for an
   embedding, one scatter-add of the scaled rows). Small per-example gradients (biases,
   LayerNorm, tokens, materialised products) are summed with the factors.

This is book-keeping ghost clipping (Bu et al. 2023) written for our modules. Supported
layers: ``nn.Linear``, ``nn.LayerNorm``, ``nn.Embedding``, patchifying ``nn.Conv2d`` (kernel
== stride), and parameters a model broadcasts over the batch itself (the class and mask
tokens), which it announces through ``broadcast_parameters()`` and ``broadcast_hooks``. Any
other trainable parameter is an error at construction: there is no silent fallback.

Under bf16/fp16 autocast the layers' inputs ``a`` and output gradients ``g`` come in that
precision, but every clipped product and every sum over the micro-batch is formed in fp32 (fp64
for an fp64 model) from those values, never rounded to bf16: a sum rounded to 8 bits once moves
by a rounding that depends on every example in it (up to 1.9 C between neighbours, issue 32).
What remains is fp32 rounding: per example, the scaled operand and the accumulation over the
tokens, bounded by ``rounding_bound`` (the factors of a layer whose ``a`` or ``g`` came in bf16/fp16
come from that bound, see ``factor_norms``, which ``training.dp.pair_clipping.PairClipper`` shares;
in fp32 and fp64 from the norm, as the equivalence tests check); between neighbours, the sum's
own rounding, which the stated sensitivity covers (``vip_hub.privacy.sensitivity``,
``rounding_terms``). Parameters must be fp32 or fp64: a bf16/fp16 ``.grad`` would round the sum
to its precision again.

``PerExampleClipper(..., exact=True)`` makes that last rounding provable instead (rule
``FP64_ONCE`` of ``vip_hub.privacy.sensitivity``, proof in ``docs/architecture.md``): every
per-example quantity and every sum across examples in fp64 from the operands' own values, the
factors from the fp64 norms raised by ``_FP64_NORM_MARGIN``, and each ``.grad`` rounded once,
so one call must form the step's whole sum. A sum over the tokens of several examples in one
product (a linear layer with more than one token per example, a patchifying convolution, an
embedding) is refused there: its error scales with each example's sum of token magnitudes,
which the clip does not bound.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn

from vip_hub.errors import ConfigError

__all__ = [
    "ClipResult",
    "LayerClipper",
    "PerExampleClipper",
    "UnsupportedLayerError",
    "add_to_grad",
    "check_max_norm",
    "clip_factors",
    "exact_fp32",
    "factor_norms",
    "norm_dtype",
    "rounding_bound",
    "rule_layers",
    "trainable",
]

# Measured on the 2-core CPU (benchmarks/README.md): forming and keeping one element of a
# per-example product costs about as much as 100 multiply-adds of a ghost norm's Gram matrices.
_PRODUCT_ELEMENT_COST = 100
# Allowance for what is evaluated in fp32 under reduced precision besides the clipped products:
# the norms, and PairClipper's contraction of each view's Jacobian with its pair weights (n + d
# terms; rounding ~1e-6).
_FP32_ALLOWANCE = 2.0**-12
_SUM_DTYPES = (torch.float32, torch.float64)
"""What clipped products, their sums and ``.grad`` are held in (issue 32)."""
_FP64_NORM_MARGIN = 2.0**-30
"""Exact mode: the factors come from the fp64 norms times 1 + this, above the relative error of
an fp64 norm over up to 2^22 terms and of the factor's division (``docs/architecture.md``)."""
_EXACT_MIN_CLIP = 2.0**-64
"""Exact mode: the smallest clip bound, so that subnormal roundings stay within the proof's
slack."""


class UnsupportedLayerError(ConfigError, TypeError):
    """A trainable parameter has no per-example gradient rule (a model the clipper cannot train)."""


@dataclass
class ClipResult:
    """What one micro-batch contributed."""

    losses: torch.Tensor  # (b,) per-example losses, detached
    norms: torch.Tensor  # (b,) per-example gradient norms before clipping (fp32)
    factors: torch.Tensor  # (b,) clip factors applied (0 for a non-finite norm)


@dataclass
class _Part:
    """One layer's per-example gradient in the cheapest form, computed once per micro-batch.

    Small per-example gradients (LayerNorm affine, biases, broadcast tokens, and weights whose
    per-example product is materialised) are held as (b, *shape). A large weight keeps the
    tokens ``a`` (b, T, in) and ``g`` (b, T, out) instead (a patch embedding keeps its input
    images as ``a``; an embedding keeps ``g`` as its rows summed per (example, id), with
    ``a`` holding those keys), and its clipped sum is formed once the factors are known.
    """

    materialised: list[tuple[nn.Parameter, torch.Tensor]]
    sq_norms: torch.Tensor  # (b,) this layer's share of the squared per-example norms
    layer: nn.Module | None = None  # the layer whose weight's clipped sum is deferred
    a: torch.Tensor | None = None
    g: torch.Tensor | None = None
    # (b,) bound on the norm of this layer's clipped contribution per unit factor, when its
    # clipped product runs in bf16/fp16 (``rounding_bound``); None in fp32 and fp64
    bound: torch.Tensor | None = None


def clip_factors(norms: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Per-example factors ``min(1, C / ||g||)`` that clip each gradient to norm ``max_norm``; 0
    for a non-finite norm (such an example must not decide whether a step happens). Every
    clipper, and the audit's canaries, clip through this one function."""
    factors = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    return torch.where(torch.isfinite(norms), factors, torch.zeros_like(factors))


def check_max_norm(max_norm: float) -> None:
    """``ValueError`` unless the clipping norm is positive: every clipper's first check."""
    if not max_norm > 0:
        raise ValueError(f"clipping norm must be positive, got {max_norm}")


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """``model``'s trainable parameters; ``ConfigError`` when it has none or one is not fp32/fp64
    (its ``.grad`` would round the clipped sum to its precision: train under autocast instead)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("the model has no trainable parameters: nothing to train")
    reduced = sorted({str(p.dtype) for p in params if p.dtype not in _SUM_DTYPES})
    if reduced:
        raise ConfigError(
            f"DP training needs fp32 or fp64 trainable parameters, got {', '.join(reduced)}: their "
            ".grad would round each clipped sum to that precision (use bf16 autocast instead)"
        )
    return params


def rule_layers(model: nn.Module, check: Callable[[nn.Module], None]) -> list[nn.Module]:
    """The modules holding ``model``'s trainable parameters besides its broadcast ones (each
    passed to ``check``, which raises for a layer with no rule); ``UnsupportedLayerError`` names
    any trainable parameter left uncovered."""
    covered = {id(p) for p in getattr(model, "broadcast_parameters", list)()}
    layers = []
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        done = [id(p) in covered for p in own]
        if any(done) and not all(done):  # a rule would count the covered ones a second time
            raise UnsupportedLayerError(
                f"{name or type(module).__name__}: some of its trainable parameters are broadcast "
                "or shared with another layer and some are not; no rule covers such a module"
            )
        if own and not any(done):
            check(module)
            layers.append(module)
            covered.update(id(p) for p in own)
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in covered]
    if missing:
        raise UnsupportedLayerError(f"no clipping rule covers parameters {', '.join(missing)}")
    return layers


def norm_dtype(params: list[nn.Parameter]) -> torch.dtype:
    """The dtype norms are accumulated in: fp64 where any parameter is fp64, else fp32."""
    return torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32


def factor_norms(
    norms: torch.Tensor, shares: list[tuple[torch.Tensor, torch.Tensor | None]]
) -> torch.Tensor:
    """The norms clip factors come from: ``norms`` themselves, or, when some share's operands came
    in bf16/fp16, an upper bound on the norm of each contribution as it is computed in fp32.
    ``shares``: each part's squared norms and its rounding bound (``rounding_bound``; None where
    its operands are fp32 or fp64)."""
    if all(bound is None for _, bound in shares):
        return norms
    sq = torch.zeros_like(norms)
    for part_sq, bound in shares:
        sq += part_sq if bound is None else bound.square()
    return sq.sqrt() * (1 + _FP32_ALLOWANCE)


def _no_autocast(x: torch.Tensor) -> torch.autocast:
    """Norms and sums run in the tensors' own precision (at least fp32), not autocast's."""
    return torch.autocast(x.device.type, enabled=False)


def _fp32(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (norms and clipped sums under bf16/fp16 autocast are computed in fp32)."""
    return x if x.dtype in _SUM_DTYPES else x.float()


@contextlib.contextmanager
def exact_fp32() -> Iterator[None]:
    """fp32 products in fp32 on CUDA: no TF32 (whose 10-bit operands cuBLAS and cuDNN may
    otherwise use for an fp32 matmul or convolution) while a clipped sum is formed."""
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = matmul.allow_tf32, cudnn.allow_tf32
    matmul.allow_tf32 = cudnn.allow_tf32 = False
    try:
        yield
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = saved


def _reduced(*tensors: torch.Tensor) -> bool:
    """Whether a layer ran in bf16/fp16: its fp32 product's rounding is then bounded."""
    return any(x.dtype.itemsize < 4 for x in tensors)


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """(b, ..., d) -> (b, T, d)."""
    return x.reshape(x.shape[0], -1, x.shape[-1])


def _sq(per_example: torch.Tensor) -> torch.Tensor:
    """Squared norms of (b, ...) per-example gradients, (b,)."""
    return per_example.reshape(per_example.shape[0], -1).square().sum(1)


def _ghost(
    a: torch.Tensor, g: torch.Tensor, cross: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``||g_i^T a_i||_F^2 = sum_{t,s} (a_t . a_s)(g_t . g_s)`` per example, and (when ``cross``)
    ``sum_t ||a_t|| ||g_t||`` (which bounds the effect of rounding either operand), both (b,).

    Both Gram matrices are symmetric: with many tokens they are formed in up to 3 strips of
    rows, each from its diagonal block rightwards, and the blocks right of the diagonal count
    twice (83% of the full products' time at 197 tokens on the CPU; one product below 96).
    Each strip's elementwise product is summed by one batched dot product (no product tensor)."""
    b, t = a.shape[:2]
    blocks = max(1, min(3, t // 48))
    edges = [t * j // blocks for j in range(blocks + 1)]
    sq = torch.zeros(b, device=a.device, dtype=a.dtype)
    norms = torch.zeros_like(sq) if cross else None
    for lo, hi in pairwise(edges):
        ga, gg = torch.bmm(a[:, lo:hi], a[:, lo:].mT), torch.bmm(g[:, lo:hi], g[:, lo:].mT)
        whole = _dot(ga, gg)
        if hi < t:  # the diagonal block once, the rest twice
            diagonal = (ga[:, :, : hi - lo] * gg[:, :, : hi - lo]).sum((1, 2))
            sq += whole.mul_(2).sub_(diagonal)
        else:
            sq += whole
        if norms is not None:
            norms += (ga.diagonal(dim1=1, dim2=2) * gg.diagonal(dim1=1, dim2=2)).sqrt().sum(1)
    return sq, norms


def _dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-example dot products of two contiguous (b, ...) tensors, (b,)."""
    b = x.shape[0]
    return torch.bmm(x.reshape(b, 1, -1), y.reshape(b, -1, 1)).reshape(b)


def rounding_bound(sq: torch.Tensor, cross: torch.Tensor, tokens: int) -> torch.Tensor:
    """Bound on ``||(c g)^T a|| / c`` for one example (one pair in ``PairClipper``) when that
    product of bf16/fp16-valued operands is formed in fp32 over ``tokens`` tokens of the batch.

    With fp32's unit roundoff u: the scaled operand rounds elementwise (at most
    ``u sum_t ||a_t|| ||g_t||`` in norm: an elementwise relative error need not stay relative to
    ``||g^T a||``), the accumulation over ``tokens`` products adds at most
    ``gamma sum_t ||a_t|| ||g_t||`` (worst case, any order), the output rounds (relative u):
    ``||.|| <= (1 + u) (||G|| + (u + (1 + u) gamma) sum_t ||a_t|| ||g_t||)``."""
    u = torch.finfo(torch.float32).eps / 2
    gamma = tokens * u / (1 - tokens * u)
    return (1 + u) * (sq.sqrt() + (u + (1 + u) * gamma) * cross)


def _materialise(b: int, t: int, i: int, o: int) -> bool:
    """Whether a weight's per-example products (b, o, i) are better than the ghost route:
    both no larger than its kept ``a`` and ``g`` and cheaper than the Gram matrices
    (the clipped sum costs one product of ``a`` and ``g`` either way)."""
    return i * o <= t * (i + o) and _PRODUCT_ELEMENT_COST * i * o < t * t * (i + o)


class LayerClipper:
    """What every layer-wise clipper holds: the model, its clip bound and trainable parameters,
    the layers its rules cover (``_check_supported`` refuses the others), and the precision its
    norms are formed in."""

    def __init__(self, model: nn.Module, max_norm: float):
        check_max_norm(max_norm)
        self.model, self.max_norm = model, float(max_norm)
        self.params = trainable(model)
        self.layers = rule_layers(model, self._check_supported)
        self.norm_dtype = norm_dtype(self.params)

    @staticmethod
    def _check_supported(m: nn.Module) -> None:
        raise NotImplementedError


class PerExampleClipper(LayerClipper):
    """Adds the sum of per-example clipped gradients of ``model`` into ``.grad``.

    ``model(*inputs)`` must return per-example losses of shape (b,) where example i's loss
    depends on example i only (no batch statistics). ``exact``: the sum across examples in fp64,
    rounded once into an empty ``.grad`` (see the module docstring).
    """

    def __init__(self, model: nn.Module, max_norm: float, *, exact: bool = False):
        super().__init__(model, max_norm)
        self.exact = exact
        if exact:
            if self.max_norm < _EXACT_MIN_CLIP:
                raise ConfigError(
                    f"exact clipped sums need a clipping norm of at least 2^-64, got {max_norm}"
                )
            self.norm_dtype = torch.float64

    @staticmethod
    def _check_supported(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            return
        if isinstance(m, nn.LayerNorm) and m.elementwise_affine:
            return
        if isinstance(m, nn.Embedding):
            if m.max_norm is not None or m.scale_grad_by_freq or m.sparse:
                raise UnsupportedLayerError(
                    "nn.Embedding with max_norm (renormalises rows of the table from the batch's "
                    "ids), scale_grad_by_freq (a gradient that depends on the whole batch) or "
                    "sparse gradients has no per-example gradient rule"
                )
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
            "gradient rule; supported: nn.Linear, nn.LayerNorm, nn.Embedding, patchifying nn.Conv2d"
        )

    def accumulate(self, *inputs: torch.Tensor) -> ClipResult:
        """Run ``model(*inputs)`` and add the clipped per-example gradient sum into ``.grad``.

        The model may run its layers on K rows per example (augmentation multiplicity: K views of
        each example, example i's rows ``i*K .. i*K+K-1``) as long as it returns one loss per
        example: each layer's per-example gradient is then summed over the example's K rows
        before the norm (``_grouped``), so what is clipped is the example's whole gradient."""
        if self.exact and any(p.grad is not None for p in self.params):
            raise ConfigError(
                "exact clipped sums are rounded once into an empty .grad: one call per step "
                "(no micro-batches), .grad set to None between steps"
            )
        parts: list[_Part] = []
        targets: list[torch.Tensor] = []  # backward runs from the loss down to these only
        grad_hooks: list[torch.utils.hooks.RemovableHandle] = []
        seen: set[int] = set()
        examples: list[int] = []  # the number of examples, known once the losses are

        def when_grad(
            module: nn.Module | nn.Parameter, a: torch.Tensor | None
        ) -> Callable[[torch.Tensor], None]:
            held = [a]  # let go of the input once used: a LayerNorm's input is needed no longer

            def hook(g: torch.Tensor) -> None:
                with torch.no_grad(), _no_autocast(g):
                    a_in, g_in = _grouped(module, held.pop(), g, examples[0])
                    if self.exact:
                        parts.append(_exact_part(module, _fp64(a_in), g_in.double()))
                    else:
                        parts.append(self._part(module, a_in, g_in))

            return hook

        def on_forward(
            module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor
        ) -> None:
            if id(module) in seen:
                raise UnsupportedLayerError(
                    f"{type(module).__name__} is called twice in one forward pass; "
                    "per-example norms would miss the cross terms"
                )
            seen.add(id(module))
            if (
                args[0].grad_fn is None
            ):  # an entry layer (on the images or token ids): backward stops here
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
            raise ValueError(
                f"the model must return per-example losses (b,), got {tuple(losses.shape)}"
            )
        examples.append(losses.shape[0])
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
            bounded = factor_norms(norms, [(p.sq_norms, p.bound) for p in parts])
            if self.exact:
                bounded = bounded * (1 + _FP64_NORM_MARGIN)
            factors = clip_factors(bounded, self.max_norm)
            dropped = factors == 0
            dropped = dropped if bool(dropped.any()) else None  # one device sync per micro-batch
            with exact_fp32():
                while parts:  # each layer's kept tensors go as soon as its sum is added
                    self._add_clipped(parts.pop(), factors, dropped)
        return ClipResult(losses.detach(), norms, factors)

    # ---------------------------------------------------------------- per-layer rules
    @staticmethod
    def _part(m: nn.Module | nn.Parameter, a_in: torch.Tensor | None, g: torch.Tensor) -> _Part:
        """Layer ``m``'s per-example gradient (see ``_Part``) and squared norms, from its
        input ``a_in`` and its output's gradient ``g``."""
        if isinstance(m, nn.Parameter):  # broadcast over the batch: the gradient sums over tokens
            pe = _fp32(_tokens(g)).sum(1)
            return _Part([(m, pe)], _sq(pe))
        if isinstance(m, nn.Embedding):
            return _embedding_part(m, a_in, g)
        # Tokens (b, T, features) in the tensors' own dtype; all arithmetic in at least fp32.
        g_tok = g.flatten(2).transpose(1, 2) if isinstance(m, nn.Conv2d) else _tokens(g)
        gt = _fp32(g_tok)
        small = [(m.bias, gt.sum(1))] if m.bias is not None else []
        if isinstance(m, nn.LayerNorm):
            xhat = _tokens(F.layer_norm(_fp32(a_in), m.normalized_shape, eps=m.eps))
            small.append((m.weight, xhat.mul_(gt).sum(1)))
            return _Part(small, sum(_sq(pe) for _, pe in small))
        sq = sum(
            (_sq(pe) for _, pe in small), torch.zeros(g.shape[0], device=g.device, dtype=gt.dtype)
        )
        if isinstance(m, nn.Conv2d):
            return _conv_part(m, a_in, g, g_tok, small, sq)
        a_tok = _tokens(a_in)
        a = _fp32(a_tok)
        b, t, i, o = *a.shape, gt.shape[2]
        if _materialise(b, t, i, o):
            pe = torch.bmm(gt.mT, a)
            small.append((m.weight, pe))
            return _Part(small, sq + _sq(pe))
        ghost, cross = _ghost(a, gt, _reduced(a_tok, g_tok))
        bound = rounding_bound(sq + ghost, cross, b * t) if cross is not None else None
        return _Part(small, sq + ghost, m, a_tok, g_tok, bound)

    @staticmethod
    def _add_clipped(part: _Part, factors: torch.Tensor, dropped: torch.Tensor | None) -> None:
        """Add sum_i factors_i * g_i for each of the layer's parameters into ``.grad``."""
        # ``dropped`` marks non-finite examples: 0 * nan is nan, so zero their values outright.
        for param, pe in part.materialised:
            if dropped is not None:
                pe = torch.where(dropped.view(-1, *[1] * (pe.ndim - 1)), 0.0, pe)
            add_to_grad(param, torch.einsum("b,b...->...", factors.to(pe.dtype), pe))
        m = part.layer
        if m is None:
            return
        if isinstance(
            m, nn.Embedding
        ):  # rows summed per (example, id); keys = example * vocab + id
            keys, rows = part.a, part.g
            example = keys // m.num_embeddings
            rows = rows * factors.to(rows.dtype)[example, None]
            if dropped is not None:
                rows = torch.where(dropped[example, None], 0.0, rows)
            table = torch.zeros(m.weight.shape, device=rows.device, dtype=rows.dtype)
            add_to_grad(m.weight, table.index_add_(0, keys % m.num_embeddings, rows))
            return
        # The product and its sum in at least fp32 from the values the norms came from (bf16 ones
        # under autocast, converted exactly), never rounded to bf16 (see the module docstring).
        a, g = _fp32(part.a), _fp32(part.g)
        dtype = torch.promote_types(a.dtype, g.dtype)
        a, g = a.to(dtype), g.to(dtype)
        if dropped is not None:
            a = torch.where(dropped.view(-1, *[1] * (a.ndim - 1)), 0.0, a)
            g = torch.where(dropped.view(-1, *[1] * (g.ndim - 1)), 0.0, g)
        c = factors.to(dtype)
        if isinstance(m, nn.Conv2d):  # the convolution's own weight-gradient kernel, on c * g
            grad = torch.nn.grad.conv2d_weight(
                a, m.weight.shape, g * c.view(-1, 1, 1, 1), stride=m.stride
            )
            add_to_grad(m.weight, grad)
            return
        # sum_i c_i g_i^T a_i: scale the smaller side, then one product over all tokens.
        if a.shape[2] <= g.shape[2]:
            a = a * c[:, None, None]
        else:
            g = g * c[:, None, None]
        add_to_grad(m.weight, g.reshape(-1, g.shape[2]).T @ a.reshape(-1, a.shape[2]))


def _fp64(x: torch.Tensor | None) -> torch.Tensor | None:
    """A floating-point input in fp64 (exactly: fp32, bf16 and fp16 values are fp64 values)."""
    return x.double() if x is not None and x.is_floating_point() else x


def _exact_part(m: nn.Module | nn.Parameter, a_in: torch.Tensor | None, g: torch.Tensor) -> _Part:
    """``PerExampleClipper._part`` on fp64 operands, for exact mode: refused where the clipped sum
    would be one product over the tokens of several examples."""
    part = PerExampleClipper._part(m, a_in, g)
    layer = part.layer
    if layer is not None and not (isinstance(layer, nn.Linear) and part.a.shape[1] == 1):
        tokens = part.a.shape[1] if isinstance(layer, nn.Linear) else "its"
        raise UnsupportedLayerError(
            f"exact clipped sums: {type(layer).__name__} sums {tokens} tokens per example in one "
            "product across examples, whose rounding the clip does not bound; exact mode takes "
            "per-example contributions summed across examples only"
        )
    return part


def _grouped(
    m: nn.Module | nn.Parameter, a: torch.Tensor | None, g: torch.Tensor, examples: int
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """A layer's input and output gradient with each example's K consecutive rows (its views)
    made one example: tokens (b K, T, d) -> (b, K T, d), a patchifying convolution's images and
    output maps stacked along the height (b K, c, h, w) -> (b, c, K h, w), an embedding's ids
    (b K, T) -> (b, K T). The per-example gradient over the K T tokens is the sum of the views'
    gradients, which the rules then compute as for one example."""
    rows = g.shape[0]
    if rows == examples:
        return a, g
    if examples == 0 or rows % examples:
        raise ValueError(f"{rows} rows for {examples} per-example losses: not K rows per example")
    if isinstance(m, nn.Conv2d):
        return _stack_views(a, examples), _stack_views(g, examples)  # type: ignore[arg-type]
    if isinstance(m, nn.Embedding):
        return a.reshape(examples, -1), g.reshape(examples, -1, g.shape[-1])  # type: ignore[union-attr]
    a_out = None if a is None else a.reshape(examples, -1, a.shape[-1])
    return a_out, g.reshape(examples, -1, g.shape[-1])


def _stack_views(x: torch.Tensor, examples: int) -> torch.Tensor:
    """(b K, c, h, w) -> (b, c, K h, w): each example's K maps one above the other."""
    _, c, h, w = x.shape
    views = x.reshape(examples, -1, c, h, w)
    return views.transpose(1, 2).reshape(examples, c, views.shape[1] * h, w)


def _conv_part(
    m: nn.Conv2d,
    images: torch.Tensor,
    g: torch.Tensor,
    g_tok: torch.Tensor,
    small: list[tuple[nn.Parameter, torch.Tensor]],
    sq: torch.Tensor,
) -> _Part:
    """A patchifying convolution: the ghost norm over its patches, unfolded a few examples at a
    time (this runs last in the backward pass, at its memory peak); it keeps its input images,
    not their patches, and its clipped sum is the convolution's own weight gradient."""
    reduced = _reduced(images, g)
    ghost, cross = [], []
    for chunk in range(0, images.shape[0], 8):
        rows = slice(chunk, chunk + 8)
        patches = F.unfold(images[rows], m.kernel_size, stride=m.kernel_size).transpose(1, 2)
        s, x = _ghost(_fp32(patches).contiguous(), _fp32(g_tok[rows]).contiguous(), reduced)
        ghost.append(s)
        cross.append(x)
    ghost_sq = torch.cat(ghost)
    bound = (
        rounding_bound(sq + ghost_sq, torch.cat(cross), g_tok.shape[0] * g_tok.shape[1])
        if reduced
        else None
    )
    return _Part(small, sq + ghost_sq, m, images, g, bound)


def _embedding_part(m: nn.Embedding, ids: torch.Tensor, g: torch.Tensor) -> _Part:
    """An embedding: example i's gradient adds its output-gradient rows into the rows of its ids,
    so its nonzero rows are the sums of ``g`` over equal ids within the example (the ghost form
    ``sum_{t,s} [id_t = id_s] g_t . g_s``, in O(T d) instead of O(T^2 d)). Kept: those summed
    rows and their keys ``example * vocab + id``; the clipped sum scatter-adds the scaled rows."""
    gt = _fp32(_tokens(g))
    b, d = gt.shape[0], gt.shape[2]
    ids = ids.reshape(b, -1)
    if m.padding_idx is not None:  # no gradient reaches the padding row
        gt = gt * (ids != m.padding_idx)[..., None]
    example = torch.arange(b, device=ids.device)[:, None]
    keys, where = torch.unique(example * m.num_embeddings + ids, return_inverse=True)
    rows = gt.new_zeros(len(keys), d).index_add_(0, where.flatten(), gt.reshape(-1, d))
    sq = gt.new_zeros(b).index_add_(0, keys // m.num_embeddings, rows.square().sum(1))
    return _Part([], sq, m, keys, rows)


def add_to_grad(param: nn.Parameter, grad: torch.Tensor) -> None:
    """``param.grad += grad`` (``grad`` is a fresh tensor: it may become ``.grad`` itself)."""
    grad = grad.reshape(param.shape).to(param.dtype)
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad
