"""The fp64 bounds the clippers' proofs stand on, checked in exact arithmetic: Higham's gamma_k
rounded up, ``upper_sq`` at least the largest sum its evaluation can stand for, and
``capped_factors`` keeping c sqrt(sq) <= C to the last bit; and what the clippers hand those
bounds: every layer's cross term, each pair's own views, the batch's bound, products that leave
room for the cotangents' depth (mutants of each survived the suite by an ulp to 1e-8 before
these tests)."""

from __future__ import annotations

from fractions import Fraction
from types import ModuleType

import pytest
import torch
from support.clipping import exact_gamma
from torch import nn
from torch.overrides import TorchFunctionMode

import training.dp.clipping
import training.dp.pair_clipping
from training.dp.clipping import (
    PerExampleClipper,
    capped_factors,
    ghost_bounds,
    product_sum,
    upper_sq,
)
from training.dp.pair_clipping import BatchClipper, PairClipper, embed, symmetric_infonce
from vip_hub.privacy.sensitivity import PRODUCT_ROWS, gamma64


@pytest.mark.parametrize("k", [*range(1, 200), 4097, 2**16 + 1, 1_000_003, 2**32 + 1])
def test_gamma64_is_at_least_the_exact_gamma(k: int) -> None:
    assert Fraction(gamma64(k)) >= exact_gamma(k)


@pytest.mark.parametrize("terms", [1, 2, 3, 5, 8, 100, 4097, 1_000_000, 86_000_000])
def test_upper_sq_bounds_every_sum_its_fp64_evaluation_stands_for(terms: int) -> None:
    """A sum of ``terms`` non-negative reals evaluated as ``sq`` in fp64 is at most
    sq / (1 - gamma_{terms}): ``upper_sq`` must reach that, exactly."""
    gen = torch.Generator().manual_seed(0)
    sq = torch.exp(torch.empty(500, dtype=torch.float64).uniform_(-30, 30, generator=gen))
    bound = upper_sq(sq, terms)
    need = 1 - exact_gamma(terms)
    short = [i for i in range(len(sq)) if Fraction(bound[i].item()) * need < Fraction(sq[i].item())]
    assert not short, f"{len(short)} of {len(sq)} bounds fall short at {terms} terms"


@pytest.mark.parametrize("clip", [1e-3, 0.7, 1.0, 3.3])
def test_capped_factors_clip_to_the_last_bit(clip: float) -> None:
    """c sqrt(sq) <= C in exact arithmetic, also where sqrt(sq) is so large that the 1e-6 in
    ``clip_factors`` no longer covers a rounding."""
    gen = torch.Generator().manual_seed(1)
    sq = torch.exp(torch.empty(2000, dtype=torch.float64).uniform_(20, 60, generator=gen))
    factors = capped_factors(sq, torch.zeros_like(sq), clip)
    over = [
        i
        for i in range(len(sq))
        if Fraction(factors[i].item()) ** 2 * Fraction(sq[i].item()) > Fraction(clip) ** 2
    ]
    assert not over, f"{len(over)} of {len(sq)} factors clip above C = {clip}"


class _InnerDimensions(TorchFunctionMode):
    """Records the inner dimension (rows added up) of every matrix product under it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if getattr(func, "__name__", "") in ("matmul", "__matmul__", "mm"):
            self.seen.append(args[0].shape[-1])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("tokens", "rows"), [(3, 10), (7, 20), (5, 5), (4, 9), (1, 6)])
def test_product_sum_adds_at_most_rows_rows_in_one_product(tokens: int, rows: int) -> None:
    """gamma_{rows+1} in the allowance covers products over at most ``rows`` rows: whole
    examples are grouped so that no product adds more."""
    gen = torch.Generator().manual_seed(2)
    g = torch.randn(13, tokens, 6, generator=gen)
    a = torch.randn(13, tokens, 4, generator=gen)
    with _InnerDimensions() as mode:
        total = product_sum(g, a, torch.ones(13), rows)
    assert mode.seen and max(mode.seen) <= rows, mode.seen
    exact = torch.einsum("bto,bti->oi", g.double(), a.double())
    torch.testing.assert_close(total, exact)


def _spy_factors(
    monkeypatch: pytest.MonkeyPatch, module: ModuleType
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (sq, cross) every clip factor ``module``'s clippers take is computed from."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def factors(sq: torch.Tensor, cross: torch.Tensor, max_norm: float) -> torch.Tensor:
        seen.append((sq.clone(), cross.clone()))
        return capped_factors(sq, cross, max_norm)

    monkeypatch.setattr(module, "capped_factors", factors)
    return seen


class _TwoGhostLayers(nn.Module):
    """Two wide bias-free layers on 4 tokens: both take the ghost route, each with a cross term."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x))).square().sum((1, 2))


def test_the_clip_factors_see_every_layers_cross_term(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each ghost-norm layer's rounding is bounded by its own cross term X: the factors must be
    taken from the sum of them all (c X <= C / kappa), not from one layer's."""
    crosses: list[torch.Tensor] = []

    def ghost(a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sq, cross = ghost_bounds(a, g)
        crosses.append(cross)
        return sq, cross

    monkeypatch.setattr(training.dp.clipping, "ghost_bounds", ghost)
    seen = _spy_factors(monkeypatch, training.dp.clipping)
    torch.manual_seed(3)
    clipper = PerExampleClipper(_TwoGhostLayers().double(), 1.0)
    clipper.accumulate(torch.randn(5, 4, 64, dtype=torch.float64))
    assert len(crosses) == 2 and len(seen) == 1
    torch.testing.assert_close(seen[0][1], crosses[0] + crosses[1], rtol=1e-12, atol=0)


class _PairModel(nn.Module):
    """Logit-DP's embeddings from one bias-free Linear(2, 8), averaged over the tokens if any."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.linear = nn.Linear(2, 8, bias=False).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        return out.mean(1) if out.ndim == 3 else out


def test_swapping_the_views_transposes_the_pairs_norms_and_cross_terms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pair (i, j) joins example i's first view and example j's second: X_ij = F_i + F'_j, so
    the batch with its views swapped has the transposed bounds."""
    seen = _spy_factors(monkeypatch, training.dp.pair_clipping)
    model = _PairModel()
    gen = torch.Generator().manual_seed(5)
    v1 = torch.randn(6, 3, 2, generator=gen, dtype=torch.float64)
    v2 = 3 * torch.randn(6, 3, 2, generator=gen, dtype=torch.float64)
    PairClipper(model, 1.0, 0.5).accumulate(v1, v2)
    PairClipper(model, 1.0, 0.5).accumulate(v2, v1)
    (sq, cross), (sq_swapped, cross_swapped) = seen
    assert not torch.allclose(cross, cross.T)  # the two views' cross terms differ
    torch.testing.assert_close(cross_swapped, cross.T, rtol=1e-12, atol=0)
    torch.testing.assert_close(sq_swapped, sq.T, rtol=1e-9, atol=0)


def test_the_batch_clippers_norm_bounds_the_sum_it_evaluated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Naive-DP's factor comes from an upper bound on the whole gradient's squared norm: at
    least the fp64 sum of its squares divided by (1 - gamma_terms), exactly."""
    seen = _spy_factors(monkeypatch, training.dp.pair_clipping)
    model = _PairModel()
    gen = torch.Generator().manual_seed(6)
    v1, v2 = (torch.randn(7, 2, generator=gen, dtype=torch.float64) for _ in range(2))
    BatchClipper(model, 1e-3, 0.5).accumulate(v1, v2)
    ((sq, _),) = seen
    e = embed(model, v1, v2)
    (grad,) = torch.autograd.grad(
        symmetric_infonce(e[:7] @ e[7:].T, 0.5).sum(), model.linear.weight
    )
    total = grad.double().square().sum()
    assert Fraction(sq.item()) * (1 - exact_gamma(grad.numel())) >= Fraction(total.item())


def test_the_pair_clippers_products_leave_room_for_the_depth_of_their_cotangents(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A weight's pair-clipped sum adds each view's cotangent (n pairs and d coordinates deep,
    and 2 more) inside products over its tokens: the products may add no more than
    PRODUCT_ROWS less that depth. 4 examples of 8,191 tokens: 8 views fit PRODUCT_ROWS only
    without the reserve."""
    n, tokens, d = 4, 8191, 8
    inner: list[int] = []

    def recorded(g: torch.Tensor, a: torch.Tensor, scale: torch.Tensor, rows: int) -> torch.Tensor:
        with _InnerDimensions() as mode:
            total = product_sum(g, a, scale, rows)
        inner.extend(mode.seen)
        return total

    monkeypatch.setattr(training.dp.pair_clipping, "product_sum", recorded)
    gen = torch.Generator().manual_seed(7)
    v1, v2 = (torch.randn(n, tokens, 2, generator=gen, dtype=torch.float64) for _ in range(2))
    PairClipper(_PairModel(), 1.0, 0.5).accumulate(v1, v2)
    assert inner and 2 * n * tokens > PRODUCT_ROWS - n - d - 2
    assert max(inner) + n + d + 2 <= PRODUCT_ROWS, inner
