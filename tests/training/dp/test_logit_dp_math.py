"""Logit-DP and Naive-DP, proven by test: the per-pair clipper's sum is the pair-by-pair one,
no pair of neighbouring batches (random or adversarial) moves it by more than the sensitivity
of docs/logit_dp_sensitivity.md, the adversary does move it by more than the bound without
1/tau, and ``vip-hub verify`` accepts the right claim and rejects the 1/tau-free one."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from support.clipping import ADVERSARY_BOUND, clipped_sum, logit_dp_adversary
from torch import nn

import training.dp.pair_clipping
from training.dp.clipping import clip_factors
from training.dp.pair_clipping import (
    BatchClipper,
    ContrastiveEmbedder,
    PairClipper,
    embed,
    symmetric_infonce,
)
from vip_hub.errors import AccountingError, ClaimTooLowError
from vip_hub.models.encoders import EncoderSpec, create_encoder
from vip_hub.privacy.ledger import Dataset, DPStage, PrivacyLedger
from vip_hub.privacy.sensitivity import (
    CONTRASTIVE_LOSS,
    logit_dp_sensitivity,
    logit_dp_sensitivity_at,
    naive_dp_sensitivity,
    sensitivity,
)
from vip_hub.repo.verify import verify_repo
from vip_hub.repo_format import LEDGER_FILE


# ------------------------------------------------------------------------------- the loss
def test_symmetric_infonce_is_the_mean_of_row_and_column_cross_entropy() -> None:
    z = torch.rand(5, 5, generator=torch.Generator().manual_seed(0)) * 2 - 1
    tau = 0.3
    logits = z / tau
    rows = torch.logsumexp(logits, 1) - logits.diag()
    cols = torch.logsumexp(logits, 0) - logits.diag()
    assert torch.allclose(symmetric_infonce(z, tau), (rows + cols) / 2, atol=1e-6)


def test_the_loss_weights_read_similarities_within_one() -> None:
    """The sensitivity's proof (F2) puts every similarity Z_ij in [-1, 1], and so every logit in
    [-1/tau, 1/tau]; embeddings normalised in fp32 give products a few ulps past 1 (here, norms
    of 1.001 stand in for them). The weights are the softmax derivative of Z clamped to [-1, 1],
    in fp64."""
    n, tau = 4, 0.1
    e = F.normalize(torch.randn(2 * n, 8, generator=torch.Generator().manual_seed(1)), dim=1)
    e[n:] = e[:n]  # each positive pair alike: Z_ii = |e_i|^2
    e = e * 1.001
    z = (e[:n].double() @ e[n:].double().T).clamp(-1, 1)
    eye = torch.eye(n, dtype=torch.float64)
    expected = ((z / tau).softmax(1) - eye + (z / tau).softmax(0) - eye) / (2 * tau)
    weights, losses = training.dp.pair_clipping._loss_weights(e, tau)
    assert weights.dtype == torch.float64 and losses.dtype == e.dtype
    assert torch.allclose(weights, expected, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- exactness
def _pair_by_pair(
    model: nn.Module, views1: torch.Tensor, views2: torch.Tensor, tau: float
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The naive computation: every pair gradient grad Z_ij from its own forward and backward,
    and lambda in closed form: ((P - I) + (Q - I)) / (2 tau), P and Q the row and column softmax."""
    params = [p for p in model.parameters() if p.requires_grad]
    n = views1.shape[0]
    pair_grads, norms = [], torch.zeros(n, n)
    for i in range(n):
        for j in range(n):
            e = embed(model, views1[i : i + 1], views2[j : j + 1])
            g = torch.autograd.grad(e[0] @ e[1], params, allow_unused=True)
            flat = torch.cat(
                [
                    (torch.zeros_like(p) if gi is None else gi).reshape(-1)
                    for p, gi in zip(params, g, strict=True)
                ]
            )
            pair_grads.append(flat)
            norms[i, j] = (
                flat.double().norm()
            )  # torch's fp32 norm of millions of entries is off by 1e-4
    with torch.no_grad():
        e = embed(model, views1, views2)
        logits = e[:n] @ e[n:].T / tau
    eye = torch.eye(n)
    weights = (logits.softmax(1) - eye + logits.softmax(0) - eye) / (2 * tau)
    return pair_grads, norms, weights


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(12, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 6)
    )


def _convnet() -> nn.Module:  # a stride-1 padded conv (materialised rule) and a strided one
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.GELU(),
        nn.Conv2d(4, 6, 3, stride=2),
        nn.GELU(),
        nn.Flatten(),
        nn.Linear(6 * 3 * 3, 6),
    )


def _vip_nano() -> nn.Module:
    """vip-nano at 32 px cut to its first 2 blocks (for time): every layer kind of the ViT, with
    the class token and the position embedding trainable."""
    encoder = create_encoder(EncoderSpec("vip-nano", img_size=32, patch_size=16))
    encoder.blocks = encoder.blocks[:2]
    return ContrastiveEmbedder(encoder, dim=8)


@pytest.mark.parametrize(
    ("build", "shape", "n"),
    [(_mlp, (3, 2, 2), 5), (_convnet, (3, 8, 8), 4), (_vip_nano, (3, 32, 32), 3)],
    ids=["mlp-layernorm", "convnet", "vip-nano-2-blocks-32px"],
)
def test_pair_clipper_equals_the_pair_by_pair_sum(build, shape, n) -> None:
    torch.manual_seed(0)
    model = build()
    views1, views2 = torch.randn(n, *shape), torch.randn(n, *shape)
    tau = 0.2
    pair_grads, norms, weights = _pair_by_pair(model, views1, views2, tau)
    bound = float(norms.flatten().median())  # about half the pairs clipped
    factors = clip_factors(norms, bound)
    expected = sum(
        w * f * g for w, f, g in zip(weights.flatten(), factors.flatten(), pair_grads, strict=True)
    )

    clipper = PairClipper(model, bound, tau)
    result = clipper.accumulate(views1, views2)
    got = clipper.take_sum()
    assert 0 < int((result.factors < 1).sum()) < n * n
    assert torch.allclose(result.norms.float(), norms, rtol=1e-5)
    assert (got - expected.double()).norm() <= 1e-5 * expected.double().norm()
    assert torch.allclose(
        result.losses, symmetric_infonce(_similarities(model, views1, views2), tau), atol=1e-6
    )


@pytest.mark.parametrize(("build", "shape", "n"), [(_mlp, (3, 2, 2), 6), (_convnet, (3, 8, 8), 4)])
def test_pair_norm_bounds_are_at_least_the_pair_by_pair_norms_in_fp64(build, shape, n) -> None:
    """The factors come from upper bounds on the pair norms: on an fp64 model every bound the
    clipper reports is at least the norm of that pair's gradient from its own backward pass (the
    two roundings differ by a few ulp; the bound's margin for its own rounding is what keeps it
    above: without it some of these pairs fall below, by an ulp or two)."""
    torch.manual_seed(0)
    model = build().double()
    views1 = torch.randn(n, *shape, dtype=torch.float64)
    views2 = torch.randn(n, *shape, dtype=torch.float64)
    pair_grads, _, _ = _pair_by_pair(model, views1, views2, 0.2)
    exact = torch.stack([g.norm() for g in pair_grads]).reshape(n, n)
    bounds = PairClipper(model, 1e9, 0.2).accumulate(views1, views2).norms
    assert bounds.dtype == torch.float64
    assert bool((bounds >= exact).all()), (bounds / exact - 1).min().item()
    assert bool((bounds <= exact * (1 + 1e-6)).all())  # a bound, not a loose one


def _similarities(model: nn.Module, views1: torch.Tensor, views2: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        e = embed(model, views1, views2)
    return e[: len(views1)] @ e[len(views1) :].T


def test_embedder_is_the_timm_vit_with_a_head() -> None:
    torch.manual_seed(0)
    model = _vip_nano().eval()
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(model(x), model.head(model.encoder(x)))
    assert {id(p) for p in model.broadcast_parameters()} == {
        id(model.encoder.cls_token),
        id(model.encoder.pos_embed),
    }
    assert not any(type(m) is nn.GELU for m in model.modules())  # each one became _Gelu


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_embedder_gelu_is_torch_gelu_value_and_gradient(dtype: torch.dtype) -> None:
    """The embedder's GELU (its own backward, for the pair clipper's batched backward) computes
    nn.GELU and its gradient, under a batched backward of several cotangents and per example
    (``torch.func.vmap`` over the inputs)."""
    gelu = _vip_nano().head[1]
    x = (torch.linspace(-12, 12, 2001, dtype=dtype) ** 3 / 144).requires_grad_(True)
    cotangents = torch.randn(3, 2001, generator=torch.Generator().manual_seed(0), dtype=dtype)
    ours, reference = gelu(x), F.gelu(x)
    assert torch.equal(ours, reference)
    got = torch.func.vmap(lambda c: torch.autograd.grad(ours, x, c, retain_graph=True)[0])
    want = torch.autograd.grad(reference, x, cotangents, is_grads_batched=True)[0]
    tol = 1e-6 if dtype == torch.float32 else 1e-13
    given = cotangents.clone()
    assert torch.allclose(got(cotangents), want, rtol=tol, atol=tol)
    assert torch.equal(cotangents, given)  # a caller's cotangents are never written to
    per_example = torch.func.vmap(torch.func.grad(lambda xi: gelu(xi).square().sum()))
    reference_per_example = torch.func.vmap(torch.func.grad(lambda xi: F.gelu(xi).square().sum()))
    rows = x.detach().view(3, 667)
    assert torch.allclose(per_example(rows), reference_per_example(rows), rtol=tol, atol=tol)


class _ResidualGelu(nn.Module):
    """An encoder whose GELU output also feeds a residual sum (shares its gradient)."""

    num_features = 8

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.act = nn.Linear(12, 8), nn.GELU()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = self.fc(images.flatten(1)[:, :12])
        return h + self.act(h)


def test_only_gelus_feeding_one_linear_layer_get_the_overwriting_backward() -> None:
    """``_Gelu``'s batched backward overwrites the gradient it receives: only the GELUs of timm
    Mlp blocks and of the head (each feeding a linear layer alone) are swapped for it."""
    from training.dp.pair_clipping import _Gelu

    vit = ContrastiveEmbedder(create_encoder(EncoderSpec("vip-nano", img_size=32)))
    assert not any(type(m) is nn.GELU for m in vit.modules())
    residual = ContrastiveEmbedder(_ResidualGelu(), dim=4)
    assert type(residual.encoder.act) is nn.GELU and isinstance(residual.head[1], _Gelu)


# --------------------------------------------------------------------------- sensitivity
@pytest.mark.parametrize(("tau", "n"), [(0.1, 3), (0.5, 3), (1.0, 4)])
def test_adversarial_neighbours_stay_within_delta_and_exceed_it_without_one_over_tau(
    tau: float, n: int
) -> None:
    model, x1, x2 = logit_dp_adversary(n, tau, ADVERSARY_BOUND, remove=True, seed=n)
    clipper = PairClipper(model, ADVERSARY_BOUND, tau)
    moved = float((clipped_sum(clipper, x1, x2) - clipped_sum(clipper, x1[:-1], x2[:-1])).norm())
    delta_n = logit_dp_sensitivity_at(ADVERSARY_BOUND, tau, n)
    assert moved <= delta_n * (1 + 1e-9)
    assert delta_n <= logit_dp_sensitivity(
        ADVERSARY_BOUND, tau
    ) and delta_n <= logit_dp_sensitivity(ADVERSARY_BOUND, tau, max_batch=n)
    assert moved >= 0.75 * delta_n  # the bound is nearly attained: the adversary is a real one
    if tau < 1:  # the public implementation's omission: the same bound without 1/tau is exceeded
        assert moved > tau * logit_dp_sensitivity(ADVERSARY_BOUND, tau, max_batch=n)
    else:
        # and the paper's Lemma 4.5 constant (tau = 1) is too small: it conflates two probabilities
        assert moved > 2 * ADVERSARY_BOUND * (1 + (n - 2) * math.e**2 / (math.e**2 + n - 1))


@pytest.mark.parametrize("tau", [0.2, 1.0])
def test_a_capped_run_is_charged_the_norm_of_a_full_batch(tau: float) -> None:
    m = 4
    model, x1, x2 = logit_dp_adversary(m, tau, ADVERSARY_BOUND, remove=False, seed=1)
    clipper = PairClipper(model, ADVERSARY_BOUND, tau, max_batch=m)
    full = float(clipped_sum(clipper, x1, x2).norm())
    extra = torch.randn(1, 6, dtype=torch.float64)
    skipped = clipper.accumulate(
        torch.cat([x1, extra]), torch.cat([x2, extra])
    )  # m + 1: nothing added
    assert not clipper.take_sum().any() and not skipped.factors.any()
    assert full <= logit_dp_sensitivity(ADVERSARY_BOUND, tau, max_batch=m) * (1 + 1e-9)
    if tau == 1.0:  # at the boundary a cap costs more than Delta(m): the rule must charge it
        assert full > logit_dp_sensitivity_at(ADVERSARY_BOUND, tau, m)


@pytest.mark.parametrize("build", [_mlp, _convnet], ids=["mlp-layernorm", "convnet"])
def test_random_neighbours_stay_within_delta(build) -> None:
    torch.manual_seed(1)
    model = build()
    shape = (3, 2, 2) if build is _mlp else (3, 8, 8)
    for trial in range(6):
        n, tau = 2 + trial % 4, (0.1, 0.5, 1.0)[trial % 3]
        x1, x2 = torch.randn(n, *shape) * (1 + trial), torch.randn(n, *shape)
        clipper = PairClipper(model, 0.05, tau)
        drop = trial % n  # remove any one example, not only the last
        keep = [i for i in range(n) if i != drop]
        moved = float(
            (clipped_sum(clipper, x1, x2) - clipped_sum(clipper, x1[keep], x2[keep])).norm()
        )
        assert moved <= logit_dp_sensitivity_at(0.05, tau, n) * (1 + 1e-6)


def test_a_non_finite_example_is_left_out() -> None:
    torch.manual_seed(2)
    model = _mlp()
    x1, x2 = torch.randn(4, 3, 2, 2), torch.randn(4, 3, 2, 2)
    bad1 = x1.clone()
    bad1[2, 0, 0, 0] = float("inf")
    clipper = PairClipper(model, 0.05, 0.5)
    with_bad = clipper.accumulate(bad1, x2)
    got = clipper.take_sum()
    keep = [0, 1, 3]
    assert torch.equal(got, clipped_sum(clipper, x1[keep], x2[keep]))
    assert not with_bad.factors[2].any() and not with_bad.factors[:, 2].any()


def test_the_whole_sample_must_be_one_call() -> None:
    model = _mlp()
    x = torch.randn(3, 3, 2, 2)
    for clipper in (PairClipper(model, 0.05, 0.5), BatchClipper(model, 0.05, 0.5)):
        clipper.accumulate(x, x)
        with pytest.raises(RuntimeError, match="not additive over micro-batches"):
            clipper.accumulate(x, x)
        clipper.take_sum()


# ------------------------------------------------------------------------------ Naive-DP
def test_naive_dp_clips_the_batch_gradient_and_stays_within_two_c() -> None:
    c, tau = 1e-3, 0.5
    torch.manual_seed(3)
    w = torch.randn(3, 6, dtype=torch.float64).requires_grad_(True)
    x1 = torch.randn(3, 6, dtype=torch.float64).requires_grad_(True)
    x2 = torch.randn(3, 6, dtype=torch.float64).requires_grad_(True)

    def clipped(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        e = F.normalize(torch.cat([a, b]) @ w.T, dim=1)
        loss = symmetric_infonce(e[: len(a)] @ e[len(a) :].T, tau).sum()
        (g,) = torch.autograd.grad(loss, w, create_graph=True)
        return g * torch.clamp(c / g.norm(), max=1.0)

    opt = torch.optim.Adam([w, x1, x2], lr=0.1)
    for _ in range(60):
        opt.zero_grad()
        (-(clipped(w, x1, x2) - clipped(w, x1[:-1], x2[:-1])).norm()).backward()
        opt.step()
    model = nn.Linear(6, 3, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(w)
    clipper = BatchClipper(model, c, tau)
    x1, x2 = x1.detach(), x2.detach()
    result = clipper.accumulate(x1, x2)
    full = clipper.take_sum()
    assert torch.allclose(full, clipped(w, x1, x2).detach().reshape(-1), rtol=1e-4)
    assert float(full.norm()) <= c * (1 + 1e-9) and result.factors.shape == (1,)
    moved = float((full - clipped_sum(clipper, x1[:-1], x2[:-1])).norm())
    assert c < moved <= naive_dp_sensitivity(c)  # more than C: a rule of C would be wrong


# ------------------------------------------------------------------------- the rules, verify
def test_delta_grows_with_n_to_a_finite_limit() -> None:
    for tau in (0.1, 0.2, 0.5, 1.0):
        values = [logit_dp_sensitivity_at(1.0, tau, n) for n in (1, 2, 3, 10, 100, 10**4, 10**8)]
        assert values[0] == 0.0 and values == sorted(values)
        assert (
            values[-1]
            < logit_dp_sensitivity(1.0, tau)
            == pytest.approx(2 / tau * (1 + math.exp(2 / tau)))
        )
        for m in (2, 5, 256):
            assert logit_dp_sensitivity(1.0, tau, max_batch=m) >= logit_dp_sensitivity_at(
                1.0, tau, m
            )
    assert logit_dp_sensitivity(1.0, 1.0, max_batch=2) == pytest.approx(
        logit_dp_sensitivity_at(1.0, 1.0, 2)
    )


def _params(**extra) -> dict:
    return {"loss": CONTRASTIVE_LOSS, "temperature": 0.5, **extra}


def test_the_rules_read_the_ledger_params() -> None:
    assert sensitivity("Logit-DP", 0.1, _params()) == logit_dp_sensitivity(0.1, 0.5)
    assert sensitivity("Logit-DP", 0.1, _params(max_batch=64)) == logit_dp_sensitivity(0.1, 0.5, 64)
    assert sensitivity("Naive-DP", 0.1, _params()) == 0.2
    for bad in (
        {"loss": CONTRASTIVE_LOSS},
        _params(temperature=0),
        _params(temperature="0.5"),
        _params(max_batch=1),
        _params(max_batch=True),
        _params(max_batch=64.0),
        _params(cap=64),
        {**_params(), "loss": "infonce"},
        _params(temperature=0.002),
    ):
        with pytest.raises(AccountingError):
            sensitivity("Logit-DP", 0.1, bad)
    with pytest.raises(AccountingError):
        sensitivity("Naive-DP", 0.1, _params(max_batch=64))


def test_the_clippers_refuse_what_the_ledger_rules_refuse_before_training() -> None:
    """A run the export could not state is refused when its clipper is made, by the same rules:
    at tau 0.002 without a cap the sensitivity e^(2/tau) B/tau is beyond floating point."""
    for temperature, max_batch in ((0.0, None), (math.nan, 64), (0.5, 1), (0.002, None)):
        with pytest.raises(AccountingError):
            PairClipper(_mlp(), 0.1, temperature, max_batch)
    PairClipper(_mlp(), 0.1, 0.002, 64)  # capped: a finite sensitivity
    for temperature in (0.0, math.inf, -1.0):
        with pytest.raises(AccountingError, match="temperature"):
            BatchClipper(_mlp(), 0.1, temperature)


@pytest.mark.parametrize("mechanism", ["Logit-DP", "Naive-DP"])
def test_verify_accepts_the_right_delta_and_rejects_the_one_without_one_over_tau(
    tmp_path, mechanism: str
) -> None:
    params, b = _params(max_batch=256), 1e-5
    if mechanism == "Naive-DP":
        params.pop("max_batch")
    right = sensitivity(mechanism, b, params)
    wrong = (
        right * params["temperature"] if mechanism == "Logit-DP" else b
    )  # 1/tau left out; C for 2C
    for claimed, ok in ((right, True), (wrong, False)):
        stage = DPStage.from_parameters(
            name="contrastive",
            dataset=Dataset(name="digits", size=1000),
            sample_rate=0.256,
            noise_multiplier=1.0,
            steps=10,
            clipping_norm=b,
            noised_tensors={"unreleased:test": 1_000},
            mechanism=mechanism,
            sensitivity=claimed,
            mechanism_params=params,
        )
        path = tmp_path / f"{ok}.json"
        path.write_text(PrivacyLedger.build([stage]).to_json())
        problems = [
            p
            for p in verify_repo({LEDGER_FILE: path}, check_accounting=False).problems
            if p.where == "stage 'contrastive'"
        ]
        assert not problems if ok else [p.kind for p in problems] == [ClaimTooLowError]
