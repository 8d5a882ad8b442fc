"""Per-example gradient clipping without per-example gradients, with a proof (issue 52).

``PerExampleClipper.accumulate(*inputs)`` adds ``sum_i clip(g_i, C)`` to the clipper's
``ClippedSum`` (fp64, one flat buffer over the trainable parameters, taken by the DP engine with
``take_sum``), where ``g_i`` is example i's gradient and ``clip(g, C) = g * c`` with
``c <= min(1, C / ||g||)``. It never holds one full gradient per example:

1. one forward pass hooks every layer: its input ``a`` and a gradient hook on its output;
2. one backward pass (``torch.autograd.grad`` down to the entry layers' outputs only, so
   autograd skips the weight-gradient products) hands each layer its output gradient ``g``;
3. there and then, each layer's share of ``||g_i||^2`` is bounded from ``(a, g)`` alone, in fp64
   from the operands' own values (fp32, or bf16 under autocast: both exact in fp64), and only
   what step 4 needs is kept. A linear map's per-example weight gradient is
   ``G_i = g_i^T a_i`` over the example's T tokens; its squared norm is the "ghost norm"
   ``sum_{t,s} (a_t . a_s)(g_t . g_s)``, computed in fp64 and raised by a proven bound on that
   computation's error, ``eta X_i^2`` with ``X_i = sum_t ||a_t|| ||g_t||``, the "cross term"
   (``ghost_bounds``); where materialising ``G_i`` is both cheaper and no larger than the kept
   ``a`` and ``g`` (``_materialise``), it is formed in fp64 and its norm taken from it. An
   embedding's ``G_i`` scatters the rows of ``g`` by token id: its rows are summed per
   (example, id) in fp64, never a table per example. Biases, LayerNorm and broadcast tokens are
   per-example tensors of their own, formed in fp64;
4. the clip factors (``capped_factors``) come from those upper bounds, raised by 2^-30, and are
   capped so that ``c_i X_i <= C / kappa`` (``vip_hub.privacy.sensitivity.CROSS_CAP``); then
   each weight's clipped sum ``sum_i c_i G_i = (c * g)^T a`` is formed in fp64 as products of at
   most ``PRODUCT_ROWS`` token rows each (``product_sum``), and every sum across examples,
   micro-batches and (in the engine) ranks stays in fp64, to which the engine adds its fp64
   noise before the one rounding to the parameters' dtype.

Why this is proved where the fp32 sums of before were modelled: a product over tokens errs by
up to ``gamma_K`` times the sum of its terms' magnitudes, ``sum_i c_i X_i``, which no clip of
the norm bounds (an example's token terms may cancel: the review's witness put 100 C into one
example's share). In fp64 with the cap, that error is at most ``gamma_{R+1} b C / kappa``, and
the norm behind each factor is an upper bound of the exact per-example gradient's; the
allowance on the sensitivity (``FP64_CAPPED``, ``rounding_allowance``) follows, proof in
``docs/architecture.md``, "Rounding of the clipped sum".

This is book-keeping ghost clipping (Bu et al. 2023) written for our modules, in fp64. Supported
layers: ``nn.Linear``, ``nn.LayerNorm``, ``nn.Embedding``, patchifying ``nn.Conv2d`` (kernel
== stride), and parameters a model broadcasts over the batch itself (the class and mask
tokens), which it announces through ``broadcast_parameters()`` and ``broadcast_hooks``. Any
other trainable parameter is an error at construction: there is no silent fallback.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from vip_hub.errors import ConfigError, UnsupportedLayerError
from vip_hub.privacy.sensitivity import CROSS_CAP, MIN_CLIP, PRODUCT_ROWS, gamma64

__all__ = [
    "ClipResult",
    "ClippedSum",
    "LayerClipper",
    "PerExampleClipper",
    "SumClipper",
    "BroadcastHook",
    "broadcast",
    "capped_factors",
    "check_max_norm",
    "clip_factors",
    "ghost_bounds",
    "ieee_fp32_matmuls",
    "product_sum",
    "rule_layers",
    "trainable",
    "upper_sq",
]

BroadcastHook = Callable[[nn.Parameter, torch.Tensor], None]
"""What a clipper puts on a model's ``broadcast_hooks``: called with a parameter the model
broadcasts over the batch itself and the broadcast tensor."""


def broadcast(
    param: nn.Parameter, shape: tuple[int, ...], hooks: list[BroadcastHook]
) -> torch.Tensor:
    """``param`` expanded to ``shape`` (``-1`` keeps a dimension), announced to a clipper's
    ``hooks`` when it trains (a frozen one, such as a biases-only stage's class token, has no
    gradient to hook)."""
    out = param.expand(*shape)
    if param.requires_grad:
        for hook in hooks:
            hook(param, out)
    return out


# Measured on the 2-core CPU (the benchmarks' README): forming and keeping one element of a
# per-example product costs about as much as 100 multiply-adds of a ghost norm's Gram matrices.
_PRODUCT_ELEMENT_COST = 100
_NORM_MARGIN = 2.0**-30
"""The factors come from the fp64 upper bounds on the norms times 1 + this, above the relative
error of the square root and of the factor's division (``docs/architecture.md``)."""
PRODUCT_COLUMNS = 1024
"""Columns of the larger side converted to fp64 at once in ``product_sum`` (memory traffic only:
every entry of the sum is still one fp64 product over the same rows). Measured on the 2-core CPU
(the benchmarks' README, "The clipped product's column slices"): a wide product 3.7x faster, a
3,072-wide one the same."""
_PARAM_DTYPES = (torch.float32, torch.float64)


@dataclass
class ClipResult:
    """What one micro-batch contributed."""

    losses: torch.Tensor  # (b,) per-example losses, detached
    norms: torch.Tensor  # (b,) upper bounds on the per-example gradient norms (fp64)
    factors: torch.Tensor  # (b,) clip factors applied (0 for a non-finite norm; fp64)


class ClippedSum:
    """A step's clipped sum in fp64 over ``params`` (in their order): each parameter's share
    allocated at its first ``add`` (a clipper adds layer by layer as it lets go of what the layer
    kept, so the whole fp64 sum is never held beside everything kept), handed over flat by
    ``take``."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self._index = {id(p): i for i, p in enumerate(params)}
        self._shares: dict[int, torch.Tensor] = {}

    def add(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """Add the fp64 ``value`` (``param``'s shape, or its elements) to ``param``'s share."""
        i = self._index[id(param)]
        share = self._shares.get(i)
        if share is None:
            self._shares[i] = value.reshape(-1).to(torch.float64, copy=True)
        else:
            share += value.reshape(-1)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """``flat`` (a taken sum) as one view per parameter, in each one's shape."""
        sizes = [p.numel() for p in self.params]
        return [v.view(p.shape) for v, p in zip(flat.split(sizes), self.params, strict=True)]

    @property
    def empty(self) -> bool:
        """Whether nothing was added since the last ``take``."""
        return not self._shares

    def take(self, *tail: torch.Tensor) -> torch.Tensor:
        """The flat fp64 sum (zeros where nothing was added), followed by ``tail``'s fp64
        tensors (the engine's canary block and statistics: one buffer, one copy); the next
        ``add`` starts anew."""
        shares, self._shares = self._shares, {}
        return torch.cat(
            [
                shares[i] if i in shares else p.new_zeros(p.numel(), dtype=torch.float64)
                for i, p in enumerate(self.params)
            ]
            + [t.reshape(-1) for t in tail]
        )


def clip_factors(norms: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Per-example factors ``min(1, C / ||g||)`` that clip each gradient to norm ``max_norm``; 0
    for a non-finite norm (such an example must not decide whether a step happens). Every
    clipper, and the audit's canaries, clip through this one function."""
    factors = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    return torch.where(torch.isfinite(norms), factors, torch.zeros_like(factors))


def capped_factors(sq: torch.Tensor, cross: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``clip_factors`` of ``max(sqrt(sq) (1 + 2^-30), kappa cross)``: from fp64 upper bounds on
    each example's (pair's) squared norm ``sq`` and token cross term ``cross``, factors c with
    c ||g|| <= C and c X <= C / kappa (``FP64_CAPPED``)."""
    bounded = torch.maximum(sq.sqrt() * (1 + _NORM_MARGIN), CROSS_CAP * cross)
    return clip_factors(bounded, max_norm)


def upper_sq(sq: torch.Tensor, terms: int) -> torch.Tensor:
    """An upper bound on a sum of ``terms`` non-negative reals from its fp64 evaluation ``sq``
    (each term one rounding, then the additions in any order): ``sq (1 + 2 gamma_{terms+2})``."""
    return sq * (1 + 2 * gamma64(terms + 2))


def ghost_bounds(a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Upper bounds (fp64) on ``||g_i^T a_i||_F^2`` and on the cross term
    ``X_i = sum_t ||a_t|| ||g_t||`` per example, (b,) each, from tokens ``a`` (b, T, in) and
    ``g`` (b, T, out).

    The ghost norm ``sum_{t,s} (a_t . a_s)(g_t . g_s)`` is formed from the two Gram matrices,
    computed in fp32 from fp32 (or bf16/fp16) values and in fp64 from fp64 ones (unit u), or in
    fp64 whenever fp32 products may round inside as TF32 or bf16 (``ieee_fp32_matmuls``), their
    elementwise products and sums in fp64: a Gram entry errs by at most gamma_in (gamma_out) times
    the product of the tokens' norms, the products and the sum of the T^2 terms by
    gamma64_{T^2+4} times their magnitudes, each term counted at most three times (the strips
    below): the error is at most ``eta X^2`` with
    eta = 3 (gamma_in + gamma_out + gamma_in gamma_out + 2 gamma64_{T^2+4}), which is added.

    Underflow errs absolutely, not relatively: a product or partial sum rounded or flushed
    below the smallest normal ``tiny``, or an input flushed to 0, moves a Gram entry of ``a`` by
    at most sigma_a = 3 in tiny max(1, P_a) (P_a >= its largest entry), and a diagonal one by
    at most 2 in tiny, so n_t = sqrt((a_t . a_t + 2 in tiny)(1 + 2 gamma_in)) >= ||a_t|| and
    P_a = max_t n_t; the T^2 products, each counted at most three times, err by at most
    3 (2 sigma_a (sum_t m_t)^2 + 2 sigma_g (sum_t n_t)^2 + T^2 sigma_a sigma_g) more (m_t the
    same for ``g``), which is added, and X is taken as sum_t n_t m_t.

    Both Gram matrices are symmetric: with many tokens they are formed in up to 3 strips of
    rows, each from its diagonal block rightwards, and the blocks right of the diagonal count
    twice."""
    b, t, i = a.shape
    o = g.shape[2]
    exact = torch.float64 not in (a.dtype, g.dtype) and ieee_fp32_matmuls(a.device)
    gram = torch.float32 if exact else torch.float64
    a, g = a.to(gram), g.to(gram)
    unit, tiny = torch.finfo(gram).eps / 2, torch.finfo(gram).tiny
    gamma_in, gamma_out = _gamma(i, unit), _gamma(o, unit)
    blocks = max(1, min(3, t // 48))
    edges = [t * j // blocks for j in range(blocks + 1)]
    sq = torch.zeros(b, device=a.device, dtype=torch.float64)
    cross, sum_a, sum_g = torch.zeros_like(sq), torch.zeros_like(sq), torch.zeros_like(sq)
    peak_a, peak_g = torch.ones_like(sq), torch.ones_like(sq)  # max(1, P)
    for lo, hi in pairwise(edges):
        ga = torch.bmm(a[:, lo:hi], a[:, lo:].mT).double()
        gg = torch.bmm(g[:, lo:hi], g[:, lo:].mT).double()
        whole = _dot(ga, gg)
        if hi < t:  # the diagonal block once, the rest twice
            diagonal = (ga[:, :, : hi - lo] * gg[:, :, : hi - lo]).sum((1, 2))
            sq += whole.mul_(2).sub_(diagonal)
        else:
            sq += whole
        # the token norms' upper bounds n_t, m_t
        n = ((ga.diagonal(dim1=1, dim2=2) + 2 * i * tiny) * (1 + 2 * gamma_in)).sqrt()
        m = ((gg.diagonal(dim1=1, dim2=2) + 2 * o * tiny) * (1 + 2 * gamma_out)).sqrt()
        cross += (n * m).sum(1)
        sum_a, sum_g = sum_a + n.sum(1), sum_g + m.sum(1)
        peak_a, peak_g = torch.maximum(peak_a, n.amax(1)), torch.maximum(peak_g, m.amax(1))
    cross = cross * (1 + 2 * gamma64(t + 4))  # its own fp64 rounding
    sigma_a, sigma_g = 3 * i * tiny * peak_a, 3 * o * tiny * peak_g
    underflow = 3 * (2 * sigma_a * sum_g.square() + 2 * sigma_g * sum_a.square())
    underflow = (underflow + 3 * t * t * sigma_a * sigma_g) * (1 + 2 * gamma64(t + 8))
    eta = 3 * (gamma_in + gamma_out + gamma_in * gamma_out + 2 * gamma64(t * t + 4))
    return (sq.clamp(min=0) + eta * cross.square() + underflow) * (1 + 2 * gamma64(5)), cross


def ieee_fp32_matmuls(device: torch.device) -> bool:
    """Whether fp32 matrix products on ``device`` round as IEEE fp32 (torch's default), not with
    TF32 or bf16 inside (``torch.backends.cuda.matmul.allow_tf32``,
    ``torch.set_float32_matmul_precision``, the backends' ``fp32_precision``); a setting torch
    cannot report counts as not."""
    backends: Any = torch.backends  # (mkldnn.matmul is not in torch's type stubs)
    try:
        backend = backends.cuda.matmul if device.type == "cuda" else backends.mkldnn.matmul
        return backend.fp32_precision in ("none", "ieee")
    except (AttributeError, RuntimeError):
        return False


def _gamma(k: int, unit: float) -> float:
    """Higham's gamma_k = k u / (1 - k u) for unit roundoff ``unit``, rounded up."""
    return k * unit / (1 - k * unit) * (1 + 2.0**-40)


def _dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-example dot products of two contiguous (b, ...) tensors, (b,)."""
    b = x.shape[0]
    return torch.bmm(x.reshape(b, 1, -1), y.reshape(b, -1, 1)).reshape(b)


def product_sum(
    g: torch.Tensor, a: torch.Tensor, scale: torch.Tensor, rows: int = PRODUCT_ROWS
) -> torch.Tensor:
    """``sum_i scale_i g_i^T a_i`` (out, in) in fp64 from ``g`` (b, T, out) and ``a`` (b, T, in):
    the scale applied to the smaller side, then products over at most ``rows`` token rows each
    (whole examples; one example's T tokens at most), added up in fp64. Its error is at most
    gamma_{rows+1} sum_i |scale_i| sum_t ||a_t|| ||g_t|| in norm (``docs/architecture.md``)."""
    b, t = a.shape[:2]
    if t > rows:
        raise UnsupportedLayerError(
            f"one example holds {t} tokens in one product, more than the {rows} the clipped "
            "sum's proof covers"
        )
    per = max(1, rows // t)
    out, width = g.shape[2], a.shape[2]
    total = torch.zeros(out, width, dtype=torch.float64, device=a.device)
    for lo in range(0, b, per):
        s = scale[lo : lo + per].to(torch.float64)[:, None, None]
        if width <= out:  # the scale on the smaller side, the other converted a slice at a time
            a64 = (a[lo : lo + per].double() * s).reshape(-1, width)
            for c in range(0, out, PRODUCT_COLUMNS):
                g64 = g[lo : lo + per, :, c : c + PRODUCT_COLUMNS].double()
                total[c : c + PRODUCT_COLUMNS] += g64.reshape(-1, g64.shape[2]).T @ a64
        else:
            g64 = (g[lo : lo + per].double() * s).reshape(-1, out)
            for c in range(0, width, PRODUCT_COLUMNS):
                a64 = a[lo : lo + per, :, c : c + PRODUCT_COLUMNS].double()
                total[:, c : c + PRODUCT_COLUMNS] += g64.T @ a64.reshape(-1, a64.shape[2])
    return total


def check_max_norm(max_norm: float) -> None:
    """``ValueError`` unless the clipping norm is at least 2^-64 (every clipper's first check:
    the proof of the fp64 sums needs it, ``docs/architecture.md``)."""
    if not max_norm >= MIN_CLIP:
        raise ConfigError(f"clipping norm must be positive, at least 2^-64, got {max_norm}")


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """``model``'s trainable parameters; ``ConfigError`` when it has none or one is not fp32/fp64
    (AdamW's state and its update would lose the step in bf16: train under autocast instead)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("the model has no trainable parameters: nothing to train")
    reduced = sorted({str(p.dtype) for p in params if p.dtype not in _PARAM_DTYPES})
    if reduced:
        raise ConfigError(
            f"DP training needs fp32 or fp64 trainable parameters, got {', '.join(reduced)}: "
            "AdamW would update them in that precision (use bf16 autocast instead)"
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


def _fp32(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (bf16/fp16 values converted exactly)."""
    return x if x.dtype in _PARAM_DTYPES else x.float()


def _no_autocast(x: torch.Tensor) -> torch.autocast:
    """Norms and sums run in fp64, not autocast's precision."""
    return torch.autocast(x.device.type, enabled=False)


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """(b, ..., d) -> (b, T, d)."""
    return x.reshape(x.shape[0], -1, x.shape[-1])


def _sq(per_example: torch.Tensor) -> torch.Tensor:
    """Upper bounds on the squared norms of (b, ...) fp64 per-example tensors, (b,)."""
    flat = per_example.reshape(per_example.shape[0], -1)
    return upper_sq(flat.square().sum(1), flat.shape[1])


def _materialise(t: int, i: int, o: int) -> bool:
    """Whether a weight's per-example products (b, o, i) are better than the ghost route:
    both no larger than its kept ``a`` and ``g`` and cheaper than the Gram matrices
    (the clipped sum costs one product of ``a`` and ``g`` either way)."""
    return i * o <= t * (i + o) and _PRODUCT_ELEMENT_COST * i * o < t * t * (i + o)


@dataclass
class _Part:
    """One layer's per-example gradient in the cheapest form, computed once per micro-batch.

    Small per-example gradients (LayerNorm affine, biases, broadcast tokens, and weights whose
    per-example product is materialised) are held as fp64 (b, *shape). A large weight keeps the
    tokens ``a`` (b, T, in) and ``g`` (b, T, out) in their own dtype instead (a patch embedding
    keeps its input images as ``a``; an embedding keeps ``g`` as its fp64 rows summed per
    (example, id), with ``a`` holding those keys), and its clipped sum is formed once the
    factors are known."""

    materialised: list[tuple[torch.Tensor, torch.Tensor]]  # (parameter, per-example tensor)
    sq_norms: torch.Tensor  # (b,) upper bounds on this layer's share of the squared norms
    cross: torch.Tensor | None = None  # (b,) its token cross term, where a product is deferred
    # the layer whose weight's clipped sum is deferred
    layer: nn.Linear | nn.Conv2d | nn.Embedding | None = None
    a: torch.Tensor | None = None
    g: torch.Tensor | None = None


class SumClipper:
    """What every clipper holds: the model, its clip bound and trainable parameters, and the
    step's ``ClippedSum``, which ``take_sum`` hands to the engine."""

    def __init__(self, model: nn.Module, max_norm: float):
        check_max_norm(max_norm)
        self.model, self.max_norm = model, float(max_norm)
        self.params = trainable(model)
        self.sum = ClippedSum(self.params)

    def take_sum(self, *tail: torch.Tensor) -> torch.Tensor:
        """The clipped sum added since the last call: flat, fp64, over ``params`` in order, then
        ``tail`` (``ClippedSum.take``)."""
        return self.sum.take(*tail)


class LayerClipper(SumClipper):
    """A layer-wise clipper: a ``SumClipper`` with the layers its rules cover
    (``_check_supported`` refuses the others)."""

    def __init__(self, model: nn.Module, max_norm: float):
        super().__init__(model, max_norm)
        self.layers = rule_layers(model, self._check_supported)

    @contextmanager
    def _hooked(
        self,
        on_forward: Callable[[nn.Module, torch.Tensor, torch.Tensor], None],
        on_broadcast: BroadcastHook,
    ) -> Iterator[None]:
        """Within it, ``on_forward(layer, input, output)`` runs after each rule layer's forward
        (UnsupportedLayerError when one runs twice in a pass: its cross terms would be missed)
        and ``on_broadcast(param, output)`` for each broadcast token the model adds."""
        seen: set[int] = set()

        def forward(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            if id(module) in seen:
                raise UnsupportedLayerError(
                    f"{type(module).__name__} is called twice in one forward pass; "
                    "per-example norms would miss the cross terms"
                )
            seen.add(id(module))
            on_forward(module, args[0], out)

        handles = [m.register_forward_hook(forward) for m in self.layers]
        hooks: list[BroadcastHook] = getattr(self.model, "broadcast_hooks", [])
        hooks.append(on_broadcast)
        try:
            yield
        finally:
            for h in handles:
                h.remove()
            hooks.remove(on_broadcast)

    @staticmethod
    def _check_supported(m: nn.Module) -> None:
        raise NotImplementedError


class PerExampleClipper(LayerClipper):
    """Adds the sum of per-example clipped gradients of ``model`` into its ``ClippedSum``.

    ``model(*inputs)`` must return per-example losses of shape (b,) where example i's loss
    depends on example i only (no batch statistics). Calls add up: one per micro-batch.
    """

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
        """Run ``model(*inputs)`` and add the clipped per-example gradient sum into the sum.

        The model may run its layers on K rows per example (augmentation multiplicity: K views of
        each example, example i's rows ``i*K .. i*K+K-1``) as long as it returns one loss per
        example: each layer's per-example gradient is then summed over the example's K rows
        before the norm (``_grouped``), so what is clipped is the example's whole gradient."""
        parts: list[_Part] = []
        targets: list[torch.Tensor] = []  # backward runs from the loss down to these only
        grad_hooks: list[torch.utils.hooks.RemovableHandle] = []
        examples: list[int] = []  # the number of examples, known once the losses are

        def when_grad(
            module: nn.Module | nn.Parameter, a: torch.Tensor | None
        ) -> Callable[[torch.Tensor], None]:
            held = [a]  # let go of the input once used: a LayerNorm's input is needed no longer

            def hook(g: torch.Tensor) -> None:
                with torch.no_grad(), _no_autocast(g):
                    a_in, g_in = _grouped(module, held.pop(), g, examples[0])
                    parts.append(_part(module, a_in, g_in))

            return hook

        def on_forward(module: nn.Module, a: torch.Tensor, out: torch.Tensor) -> None:
            if a.grad_fn is None:  # an entry layer (on the images or token ids): backward stops
                targets.append(out)
            grad_hooks.append(out.register_hook(when_grad(module, a)))

        def on_broadcast(param: nn.Parameter, out: torch.Tensor) -> None:
            targets.append(out)
            grad_hooks.append(out.register_hook(when_grad(param, None)))

        with self._hooked(on_forward, on_broadcast):
            losses = self.model(*inputs)
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
            sq = torch.zeros(losses.shape[0], device=losses.device, dtype=torch.float64)
            cross = torch.zeros_like(sq)
            for part in parts:
                sq += part.sq_norms
                if part.cross is not None:
                    cross += part.cross
            factors = capped_factors(sq, cross, self.max_norm)
            zeroed = factors == 0
            dropped = zeroed if bool(zeroed.any()) else None  # one device sync per micro-batch
            while parts:  # each layer's kept tensors go as soon as its sum is added
                self._add_clipped(parts.pop(), factors, dropped)
        return ClipResult(losses.detach(), sq.sqrt(), factors)

    def _add_clipped(
        self, part: _Part, factors: torch.Tensor, dropped: torch.Tensor | None
    ) -> None:
        """Add sum_i factors_i * g_i for each of the layer's parameters into the sum, in fp64."""
        # ``dropped`` marks non-finite examples: 0 * nan is nan, so zero their values outright.
        for param, pe in part.materialised:
            if dropped is not None:
                pe = torch.where(dropped.view(-1, *[1] * (pe.ndim - 1)), 0.0, pe)
            self.sum.add(param, torch.einsum("b,b...->...", factors, pe))
        m = part.layer
        if m is None:
            return
        assert part.a is not None and part.g is not None
        if isinstance(m, nn.Embedding):  # rows summed per (example, id); keys = example*vocab+id
            keys, rows = part.a, part.g
            example = keys // m.num_embeddings
            rows = rows * factors[example, None]
            if dropped is not None:
                rows = torch.where(dropped[example, None], 0.0, rows)
            table = torch.zeros(m.weight.shape, device=rows.device, dtype=torch.float64)
            self.sum.add(m.weight, table.index_add_(0, keys % m.num_embeddings, rows))
            return
        a, g = part.a, part.g
        if dropped is not None:
            a = torch.where(dropped.view(-1, *[1] * (a.ndim - 1)), 0.0, a)
            g = torch.where(dropped.view(-1, *[1] * (g.ndim - 1)), 0.0, g)
        if isinstance(m, nn.Conv2d):  # the convolution's weight gradient as a product over patches
            patches = F.unfold(a, m.kernel_size, stride=m.kernel_size).transpose(1, 2)
            total = product_sum(g.flatten(2).transpose(1, 2), patches, factors)
            self.sum.add(m.weight, total)
            return
        self.sum.add(m.weight, product_sum(g, a, factors))


def _part(m: nn.Module | nn.Parameter, a_in: torch.Tensor | None, g: torch.Tensor) -> _Part:
    """Layer ``m``'s per-example gradient (see ``_Part``) and the upper bounds on its squared
    norms, from its input ``a_in`` and its output's gradient ``g``. A per-example tensor is
    formed in at least fp32 from the operands (its own rounding is part of it: the norm is taken
    from exactly its values), then held in fp64."""
    if isinstance(m, nn.Parameter):  # broadcast over the batch: the gradient sums over tokens
        pe = _fp32(_tokens(g)).sum(1).double()
        return _Part([(m, pe)], _sq(pe))
    assert a_in is not None  # a layer's input (None only for a broadcast parameter)
    if isinstance(m, nn.Embedding):
        return _embedding_part(m, a_in, g)
    m = cast("nn.Linear | nn.LayerNorm | nn.Conv2d", m)  # the rest _check_supported admits
    # Tokens (b, T, features) in the tensors' own dtype.
    g_tok = g.flatten(2).transpose(1, 2) if isinstance(m, nn.Conv2d) else _tokens(g)
    gt = _fp32(g_tok)
    small: list[tuple[torch.Tensor, torch.Tensor]] = []
    if m.bias is not None and m.bias.requires_grad:
        small.append((m.bias, gt.sum(1).double()))
    if isinstance(m, nn.LayerNorm):
        if m.weight.requires_grad:
            xhat = _tokens(F.layer_norm(_fp32(a_in), m.normalized_shape, eps=m.eps))
            small.append((m.weight, xhat.mul_(gt).sum(1).double()))
        # a tensor: small holds what the layer trains (its weight, its bias or both)
        return _Part(small, cast(torch.Tensor, sum(_sq(pe) for _, pe in small)))
    sq = sum((_sq(pe) for _, pe in small), g.new_zeros(g.shape[0], dtype=torch.float64))
    if not m.weight.requires_grad:  # a frozen weight: only its bias is trained
        return _Part(small, sq)
    if isinstance(m, nn.Conv2d):
        return _conv_part(m, a_in, g, g_tok, small, sq)
    a_tok = _tokens(a_in)
    _, t, i, o = *a_tok.shape, gt.shape[2]
    if _materialise(t, i, o):
        pe = torch.bmm(gt.mT, _fp32(a_tok).to(gt.dtype)).double()
        small.append((m.weight, pe))
        return _Part(small, sq + _sq(pe))
    ghost, cross = ghost_bounds(a_tok, g_tok)
    return _Part(small, sq + ghost, cross, m, a_tok, g_tok)


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
        assert a is not None  # a layer's input (None only for a broadcast parameter)
        return _stack_views(a, examples), _stack_views(g, examples)
    if isinstance(m, nn.Embedding):
        assert a is not None  # a layer's input
        return a.reshape(examples, -1), g.reshape(examples, -1, g.shape[-1])
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
    small: list[tuple[torch.Tensor, torch.Tensor]],
    sq: torch.Tensor,
) -> _Part:
    """A patchifying convolution: the ghost bounds over its patches, unfolded a few examples at
    a time (this runs last in the backward pass, at its memory peak); it keeps its input images,
    not their patches, and its clipped sum is a product over the patches (``product_sum``)."""
    ghost, cross = [], []
    for chunk in range(0, images.shape[0], 8):
        rows = slice(chunk, chunk + 8)
        patches = F.unfold(images[rows], m.kernel_size, stride=m.kernel_size).transpose(1, 2)
        s, x = ghost_bounds(patches.contiguous(), g_tok[rows].contiguous())
        ghost.append(s)
        cross.append(x)
    return _Part(small, sq + torch.cat(ghost), torch.cat(cross), m, images, g)


def _embedding_part(m: nn.Embedding, ids: torch.Tensor, g: torch.Tensor) -> _Part:
    """An embedding: example i's gradient adds its output-gradient rows into the rows of its ids,
    so its nonzero rows are the sums of ``g`` over equal ids within the example, formed in fp64
    (a materialised per-example tensor, O(T d), never a table per example). Kept: those rows and
    their keys ``example * vocab + id``; the clipped sum scatter-adds the scaled rows in fp64."""
    gt = _fp32(_tokens(g))
    b, d = gt.shape[0], gt.shape[2]
    ids = ids.reshape(b, -1)
    if m.padding_idx is not None:  # no gradient reaches the padding row
        gt = gt * (ids != m.padding_idx)[..., None]
    example = torch.arange(b, device=ids.device)[:, None]
    keys, where = torch.unique(example * m.num_embeddings + ids, return_inverse=True)
    rows = gt.new_zeros(len(keys), d).index_add_(0, where.flatten(), gt.reshape(-1, d)).double()
    sq = rows.new_zeros(b).index_add_(0, keys // m.num_embeddings, rows.square().sum(1))
    return _Part([], upper_sq(sq, ids.shape[1] * d), None, m, keys, rows)
