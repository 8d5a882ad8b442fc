"""The fp64 bounds the clippers' proofs stand on, checked in exact arithmetic: Higham's gamma_k
rounded up, ``upper_sq`` at least the largest sum its evaluation can stand for, and
``capped_factors`` keeping c sqrt(sq) <= C to the last bit (mutants of each survived the suite
by an ulp to 1e-8 before these tests)."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from support.clipping import exact_gamma
from torch.overrides import TorchFunctionMode

from training.dp.clipping import capped_factors, product_sum, upper_sq
from vip_hub.privacy.sensitivity import gamma64


@pytest.mark.parametrize("k", [*range(1, 200), 4097, 2**16 + 1, 1_000_003, 2**32 + 1])
def test_gamma64_is_at_least_the_exactexact_gamma(k: int) -> None:
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
