"""Every clipper's sensitivity, proven by test (Dirac canaries cannot travel through ghost-norm or
pair clipping): for each clipper and each family's model (tiny), the realised clipped sums over a
batch B and over B without any one example differ, in L2 over all parameters, by at most the Delta
the ledger states, in fp64 and under bf16 autocast on the CPU, on random and adversarial inputs.
Under bf16 the proof's premise is checked too: no example's (for Logit-DP, no pair's) share of the
sum as computed exceeds its clip. A broken clip, and Logit-DP's Delta without 1/tau, fail."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import nullcontext

import pytest
import torch
from support.clipping import ADVERSARY_BOUND, TokenModel, clipped_sum, logit_dp_adversary
from torch import nn

import training.dp.clipping
import training.dp.pair_clipping
from training.dp.clipping import PerExampleClipper, _materialise
from training.dp.pair_clipping import BatchClipper, ContrastiveEmbedder, PairClipper
from training.recipes.mae import MAE, DecoderConfig
from vip_hub.models.encoders import EncoderSpec, create_encoder
from vip_hub.models.text_decoder import Captioner, TextDecoder, TextDecoderConfig
from vip_hub.privacy.sensitivity import CONTRASTIVE_LOSS, logit_dp_sensitivity_at, sensitivity

Inputs = tuple[torch.Tensor, torch.Tensor]
KINDS = ["random", "large", "far", "repeated"]
"""Random inputs; large activations (inputs x1000); one example far from the rest (x100, shifted);
repeated inputs (the last example a copy of the first; token ids repeated within every sequence)."""
PRECISIONS = ["fp64", "bf16"]
N, TOKENS, VOCAB, TEXT = (
    4,
    100,
    50,
    8,
)  # examples per batch, token model length, vocabulary, caption
CLIP, TAU = 1e-3, 0.1  # below every example's and pair's norm: each one is clipped


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny tensors: a second intra-op thread only spins (on a loaded 2-core machine, 20x
    slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _vip() -> MAE:
    """ViP's MAE: vip-nano at 32 px cut to one encoder block, a one-block decoder of width 32."""
    encoder = create_encoder(EncoderSpec("vip-nano", img_size=32, patch_size=8), mae_init=True)
    encoder.blocks = encoder.blocks[:1]
    return MAE(encoder, DecoderConfig(dim=32, depth=1, num_heads=4))


def _dpcap() -> Captioner:
    """DP-Cap's captioner: dpcap-nano at 32 px cut to one block, a one-block text decoder."""
    spec = EncoderSpec("dpcap-nano", img_size=32, patch_size=16)
    encoder = create_encoder(spec, mae_init=True)
    encoder.blocks = encoder.blocks[:1]
    return Captioner(
        encoder,
        TextDecoder(
            TextDecoderConfig.for_encoder(
                spec,
                width=32,
                depth=1,
                num_heads=4,
                vocab_size=VOCAB,
                max_length=TEXT,
                bos_id=1,
                eos_id=2,
                pad_id=0,
            )
        ),
    )


def _embedder() -> ContrastiveEmbedder:
    """Logit-DP's (and Naive-DP's) embedder: vip-nano at 32 px cut to one block, projection to 8."""
    encoder = create_encoder(EncoderSpec("vip-nano", img_size=32, patch_size=16))
    encoder.blocks = encoder.blocks[:1]
    return ContrastiveEmbedder(encoder, dim=8)


PER_EXAMPLE: dict[str, Callable[[], nn.Module]] = {
    "vip": _vip,
    "dpcap": _dpcap,
    "tokens": lambda: TokenModel(vocab=VOCAB),
}
"""The per-example families, and the token model: an embedding with padding and a linear layer
over 100 tokens (the ghost norm in strips) beside a narrow one (per-example products)."""


def _model(build: Callable[[], nn.Module], precision: str) -> nn.Module:
    """The model in fp64, or in fp32 under bf16 autocast (autocast leaves fp64 alone)."""
    torch.manual_seed(0)
    return build().to(torch.float64 if precision == "fp64" else torch.float32)


def _autocast(precision: str) -> torch.autocast | nullcontext[None]:
    """bf16 autocast on the CPU, or nothing for fp64."""
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else nullcontext()


def _images(kind: str, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """N images (3, 32, 32) of the given kind."""
    x = torch.randn(N, 3, 32, 32, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    if kind == "large":
        x *= 1e3
    elif kind == "far":
        x[0] = x[0] * 100 + 50
    elif kind == "repeated":
        x[-1] = x[0]
    return x


def _per_example_inputs(family: str, kind: str, dtype: torch.dtype) -> Inputs:
    """(images, mask noise) for ViP, (images, caption ids) for DP-Cap, (ids, targets) for tokens."""
    g = torch.Generator().manual_seed(1)
    if family == "tokens":
        ids, target = (
            torch.randint(0, VOCAB, (N, TOKENS), generator=g),
            torch.randn(N, TOKENS, 4, generator=g),
        )
        if kind == "large":
            target *= 1e3
        elif kind == "far":
            target[0] = target[0] * 100 + 50
        elif kind == "repeated":
            ids[:] = 7
        return ids, target.to(dtype)
    if family == "vip":
        second = torch.rand(N, 16, generator=g, dtype=dtype)  # the mask noise
    else:
        second = torch.randint(3, VOCAB, (N, TEXT), generator=g)
        if kind == "repeated":
            second[:] = 7
        second[:, 0], second[:, -1], second[1, 5:] = 1, 2, 0  # [CLS] ... [SEP]; one caption padded
    if kind == "repeated":
        second[-1] = second[0]
    return _images(kind, dtype, seed=2), second


def _worst_ratio(clipper: object, inputs: Inputs, delta: float) -> float:
    """max over i of ||S(B) - S(B without i)|| / ``delta``, S the clipper's realised clipped sum."""
    full = clipped_sum(clipper, *inputs)
    moved = 0.0
    for i in range(N):
        keep = [j for j in range(N) if j != i]
        moved = max(
            moved, float((full - clipped_sum(clipper, *(x[keep] for x in inputs))).double().norm())
        )
    return moved / delta


def _alone(clipper: PerExampleClipper, inputs: Inputs) -> float:
    """The largest norm of one example's clipped sum, computed as a batch of its own, over C."""
    return (
        max(
            float(clipped_sum(clipper, *(x[i : i + 1] for x in inputs)).double().norm())
            for i in range(N)
        )
        / CLIP
    )


def _pair_ratios(model: nn.Module, views: Inputs) -> tuple[float, float]:
    """Worst neighbour ratios of Logit-DP (to Delta(N), the bound at this batch size, which is at
    most the capped and the uncapped rule) and of Naive-DP (to 2C)."""
    params = {"loss": CONTRASTIVE_LOSS, "temperature": TAU}
    return (
        _worst_ratio(PairClipper(model, CLIP, TAU), views, logit_dp_sensitivity_at(CLIP, TAU, N)),
        _worst_ratio(BatchClipper(model, CLIP, TAU), views, sensitivity("Naive-DP", CLIP, params)),
    )


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", PER_EXAMPLE)
def test_per_example_clipper_moves_the_sum_by_at_most_c(
    family: str, kind: str, precision: str
) -> None:
    model = _model(PER_EXAMPLE[family], precision)
    inputs = _per_example_inputs(family, kind, next(model.parameters()).dtype)
    clipper = PerExampleClipper(model, CLIP)
    with _autocast(precision):
        ratio, alone = (
            _worst_ratio(clipper, inputs, sensitivity("DP-SGD", CLIP)),
            _alone(clipper, inputs),
        )
    print(f"per-example {family} {kind} {precision}: {ratio:.7f}, one example alone {alone:.7f}")
    assert ratio <= 1 and alone <= 1
    assert ratio > (
        0.99 if precision == "fp64" else 0.95
    )  # every example is clipped: Delta cannot be lower


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family", PER_EXAMPLE)
def test_per_example_norm_bounds_are_at_least_each_examples_own_fp64_norm(
    family: str, kind: str
) -> None:
    """The factors come from upper bounds on the per-example norms: on an fp64 model every bound
    the clipper reports, each layer kind's share included, is at least the norm of that example's
    gradient from its own backward pass, and within 1e-6 of it (a bound, not a loose one)."""
    model = _model(PER_EXAMPLE[family], "fp64")
    inputs = _per_example_inputs(family, kind, torch.float64)
    bounds = PerExampleClipper(model, CLIP).accumulate(*inputs).norms
    params = [p for p in model.parameters() if p.requires_grad]
    exact = []
    for i in range(N):
        model.zero_grad()
        model(*(x[i : i + 1] for x in inputs))[0].backward()
        exact.append(torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None]).norm())
    exact_norms = torch.stack(exact)
    assert bounds.dtype == torch.float64
    assert bool((bounds >= exact_norms).all()), (bounds / exact_norms - 1).min().item()
    assert bool((bounds <= exact_norms * (1 + 1e-6)).all()), (bounds / exact_norms - 1).max().item()


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_logit_dp_and_naive_dp_move_the_sum_by_at_most_delta(kind: str, precision: str) -> None:
    model = _model(_embedder, precision)
    dtype = next(model.parameters()).dtype
    with _autocast(precision):
        pair, naive = _pair_ratios(
            model, (_images(kind, dtype, seed=3), _images(kind, dtype, seed=4))
        )
    print(
        f"Logit-DP {kind} {precision}: {pair:.4f} of Delta(n), {pair / TAU:.4f} of it without "
        f"1/tau; Naive-DP {naive:.4f} of 2C"
    )
    assert pair <= 1 and naive <= 1
    if (
        kind != "repeated"
    ):  # (removing a duplicate moves the sum less) the 1/tau-free Delta is exceeded
        assert pair > TAU


@pytest.mark.parametrize("kind", KINDS)
def test_no_pair_contributes_more_than_b_under_bf16(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Logit-DP's proof needs every pair's clipped vector as computed within B: with the loss
    weights set to one pair, the realised sum is that vector (rounding in its bf16 products
    once lifted it 0.1-0.3 % above B)."""
    model = _model(_embedder, "bf16")
    views = _images(kind, torch.float32, seed=3), _images(kind, torch.float32, seed=4)
    clipper, weights = PairClipper(model, CLIP, TAU), training.dp.pair_clipping._loss_weights
    shares = []
    for pair in range(N * N):

        def one_pair(
            e: torch.Tensor, tau: float, pair: int = pair
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.eye(N * N, dtype=e.dtype)[pair].view(N, N), weights(e, tau)[1]

        monkeypatch.setattr(training.dp.pair_clipping, "_loss_weights", one_pair)
        with _autocast("bf16"):
            shares.append(float(clipped_sum(clipper, *views).double().norm()) / CLIP)
    print(f"pairs {kind}: {min(shares):.5f} to {max(shares):.5f} of B")
    assert 0.95 < min(shares) and max(shares) <= 1


@pytest.mark.parametrize(("tau", "n"), [(0.2, 3), (0.5, 3), (1.0, 4)])
def test_logit_dp_at_its_bound_stays_within_delta_under_bf16(tau: float, n: int) -> None:
    """Neighbours chosen by gradient ascent to reach Delta(n) in fp64 (e(x) = Wx / |Wx|) stay
    within it under bf16 autocast (the pair clipper's bf16 rounding once took them to 1.005)."""
    model, x1, x2 = logit_dp_adversary(n, tau, ADVERSARY_BOUND, remove=True, seed=n, steps=200)
    delta = logit_dp_sensitivity_at(ADVERSARY_BOUND, tau, n)
    ratios = []
    for precision in PRECISIONS:
        clipper = PairClipper(
            model.to(torch.float64 if precision == "fp64" else torch.float32), ADVERSARY_BOUND, tau
        )
        views = [x.to(clipper.params[0].dtype) for x in (x1, x2)]
        with _autocast(precision):
            moved = (
                clipped_sum(clipper, *views).double()
                - clipped_sum(clipper, *(x[:-1] for x in views)).double()
            )
        ratios.append(float(moved.norm()) / delta)
    print(
        f"Logit-DP adversary tau {tau} n {n}: fp64 {ratios[0]:.5f}, bf16 {ratios[1]:.5f} of "
        "Delta(n)"
    )
    assert 0.99 < ratios[0] <= 1 and ratios[1] <= 1


@pytest.mark.parametrize("clipper", ["per-example", "pair", "batch"])
def test_a_broken_clip_fails_the_check(clipper: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks above have teeth: with every clip factor 1 (nothing clipped) they fail."""
    monkeypatch.setattr(
        training.dp.clipping, "clip_factors", lambda norms, max_norm: torch.ones_like(norms)
    )
    if clipper == "per-example":
        model = _model(_vip, "fp64")
        ratio = _worst_ratio(
            PerExampleClipper(model, CLIP),
            _per_example_inputs("vip", "random", torch.float64),
            sensitivity("DP-SGD", CLIP),
        )
    else:
        model = _model(_embedder, "fp64")
        views = _images("random", torch.float64, seed=3), _images("random", torch.float64, seed=4)
        ratio = dict(zip(["pair", "batch"], _pair_ratios(model, views), strict=True))[clipper]
    assert ratio > 10


def test_the_cases_cover_every_layer_kind() -> None:
    """Between them the models hold every layer kind the clippers have a rule for, and the token
    model takes both linear routes (the ghost norm in strips, per-example products)."""
    rules = (nn.Linear, nn.Conv2d, nn.LayerNorm, nn.Embedding)

    def kinds(layers: list[nn.Module]) -> set[type]:
        return {next(rule for rule in rules if isinstance(m, rule)) for m in layers}

    covered: set[type] = set()
    for build in PER_EXAMPLE.values():
        model = build()
        covered |= kinds(PerExampleClipper(model, CLIP).layers)
        covered |= {nn.Parameter} if getattr(model, "broadcast_parameters", list)() else set()
    assert covered == {*rules, nn.Parameter}
    assert not _materialise(TOKENS, 320, 320) and TOKENS // 48 >= 2 and _materialise(TOKENS, 320, 4)
    embedder = _embedder()
    assert kinds(PairClipper(embedder, CLIP, TAU).layers) == {nn.Linear, nn.Conv2d, nn.LayerNorm}
    assert embedder.broadcast_parameters()


@pytest.mark.parametrize("out, width", [(10, 2500), (2100, 7), (6, 1024)])
def test_the_clipped_product_sliced_by_columns_is_the_whole_fp64_product(
    out: int, width: int
) -> None:
    """``product_sum`` converts the wider side to fp64 a slice of ``PRODUCT_COLUMNS`` at a time:
    every entry is still one fp64 product over the same rows, so it agrees with an fp64 einsum
    of the same products to well within the proof's allowance (about 2^-53 per row of the
    magnitudes sum_i |scale_i| sum_t ||a_t|| ||g_t||)."""
    torch.manual_seed(out + width)
    g, a, scale = torch.randn(40, 2, out), torch.randn(40, 2, width), torch.rand(40)
    got = training.dp.clipping.product_sum(g, a, scale)
    exact = torch.einsum("btj,bti,b->ji", g.double(), a.double(), scale.double())
    bound = (
        (a.double().norm(dim=2) * g.double().norm(dim=2)).sum(1) * scale.double()
    ).sum() * 1e-13
    assert got.shape == (out, width) and got.dtype == torch.float64
    assert (got - exact).abs().max() <= bound
