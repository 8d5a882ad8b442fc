"""Issue 32, point 3: the clipped sum as computed under bf16 autocast stays within the recorded
sensitivity between neighbours. A sum rounded to bf16 once moves by a rounding that depends on
every example in it (up to 1.9 C at a micro-batch of 250); formed in fp32, what remains is the
allowance ``rounding_terms`` b records: C (1 + b ceil(log2 b) 2^-23).

The scan: b identical examples against b - 1 of them, the clip C over 96 values in [1, 2), at
micro-batches 32, 128 and 250, on the CPU (autocast emulates bf16) and on CUDA where present.
The DP heads' exact clipper (``PerExampleClipper(..., exact=True)``: the sum across examples in
fp64, rounded once) is scanned against its proved allowance C (1 + b 2^-23 + (b + 1)^2 2^-52)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

import training.dp.pair_clipping
from training.dp.clipping import PerExampleClipper, UnsupportedLayerError
from training.dp.pair_clipping import BatchClipper, PairClipper
from training.recipes.probe import DPHeadLoss
from vip_hub.errors import AccountingError, ConfigError
from vip_hub.privacy.ledger import Dataset, DPStage, PrivacyLedger
from vip_hub.privacy.sensitivity import (
    CONTRASTIVE_LOSS,
    FP32_BLOCKED,
    FP64_ONCE,
    ROUNDING_SUM,
    ROUNDING_TERMS,
    sample_bound,
    sensitivity,
)
from vip_hub.repo.verify import VerificationReport, _check_mechanisms

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
BATCHES = [32, 128, 250]
CLIPS = [1 + k / 96 for k in range(96)]
TAU = 0.5


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny tensors: a second intra-op thread only spins on the loaded 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _Linear(nn.Module):
    """The issue's case: ``Linear(1, 64)``, per-example loss the sum of its outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(1, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).sum(1)


class _Patches(nn.Module):
    """The other layer rules: a patchifying convolution, LayerNorm and a linear layer over the
    patch tokens (the ghost route, the convolution's own weight-gradient kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(1, 16, kernel_size=2, stride=2)
        self.norm = nn.LayerNorm(16)
        self.linear = nn.Linear(16, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.patch(x).flatten(2).transpose(1, 2)
        return self.linear(self.norm(tokens)).sum((1, 2))


PER_EXAMPLE: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "linear": (_Linear, (1,)),
    "patches": (_Patches, (1, 2, 4)),
}


def _grad(params: list[nn.Parameter]) -> torch.Tensor:
    """The clipped sum the clipper left in ``.grad``, flat, in fp64; ``.grad`` cleared."""
    flat = torch.cat([p.grad.double().flatten() for p in params])
    for p in params:
        p.grad = None
    return flat


def _worst(
    accumulate: Callable[[torch.Tensor, float], None],
    params: list[nn.Parameter],
    x: torch.Tensor,
    delta: Callable[[float], float],
    device: str,
    precision: str = "bf16",
    scale: float = 1.0,
    every: int = 1,
) -> float:
    """max over the scanned C (every ``every``-th, times ``scale``) of
    ||G(D) - G(D without one)|| / the recorded sensitivity."""
    worst = 0.0
    for clip in (c * scale for c in CLIPS[::every]):
        sums = []
        for batch in (x, x[1:]):
            with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16"):
                accumulate(batch, clip)
            sums.append(_grad(params))
        worst = max(worst, float((sums[0] - sums[1]).norm()) / delta(clip))
    return worst


def _recorded(mechanism: str, b: int, params: dict[str, object] | None = None) -> Callable:
    return lambda clip: sensitivity(mechanism, clip, {**(params or {}), ROUNDING_TERMS: b})


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b", BATCHES)
@pytest.mark.parametrize("model", PER_EXAMPLE)
def test_per_example_sum_stays_within_the_recorded_sensitivity(
    model: str, b: int, device: str, precision: str
) -> None:
    """Under bf16 autocast the inputs are bf16 too (as a layer inside a network gets them); in
    fp32 (the CPU runs) the fp32 sum's own rounding is what the allowance covers."""
    build, shape = PER_EXAMPLE[model]
    torch.manual_seed(0)
    net = build().to(device)
    x = torch.rand(1, *shape, device=device).expand(b, *shape) + 0.5  # b identical examples
    x = x.bfloat16() if precision == "bf16" else x

    def accumulate(batch: torch.Tensor, clip: float) -> None:
        result = PerExampleClipper(net, clip).accumulate(batch)
        assert bool((result.factors < 1).all())  # every example clipped: Delta is reached

    params = [p for p in net.parameters()]
    ratio = _worst(accumulate, params, x, _recorded("DP-SGD", b), device, precision)
    print(
        f"per-example {model} b={b} {device} {precision}: worst {ratio:.8f} of the recorded "
        "C (1 + b ceil(log2 b) 2^-23)"
    )
    assert 0.99 < ratio <= 1


@pytest.mark.parametrize("b", BATCHES)
def test_a_dp_heads_exact_sum_stays_within_its_proved_allowance_and_needs_it(b: int) -> None:
    """The head's clipper (``training.recipes.probe``: cross-entropy of ``Linear(64, 10)`` on
    features) on b identical examples: the neighbours' difference stays within the recorded
    C (1 + b 2^-23 + (b + 1)^2 2^-52), and exceeds C itself somewhere in the scan, so a stage
    that did not record the allowance (or noise that ignored it) would fail here."""
    torch.manual_seed(0)
    head = DPHeadLoss(nn.Linear(64, 10))
    x = (torch.rand(1, 64) * 4 + 2).expand(b, 64)
    y = torch.zeros(b, dtype=torch.long)

    def accumulate(batch: torch.Tensor, clip: float) -> None:
        result = PerExampleClipper(head, clip, exact=True).accumulate(batch, y[: len(batch)])
        assert bool((result.factors < 1).all())

    params = list(head.parameters())
    exact = _recorded("DP-SGD", b, {ROUNDING_SUM: FP64_ONCE})
    recorded = _worst(accumulate, params, x, exact, "cpu", "fp32")
    plain = _worst(accumulate, params, x, lambda clip: clip, "cpu", "fp32")
    print(f"head b={b}: worst {recorded:.10f} of the recorded allowance, {plain:.10f} of C")
    assert 0.99 < recorded <= 1 < plain


def test_the_exact_clipper_refuses_sums_over_tokens_and_a_second_call() -> None:
    """Exact mode takes per-example contributions summed across examples only (a product over
    several tokens of each example is refused) and rounds once into an empty ``.grad``."""
    net = _Patches()
    with pytest.raises(UnsupportedLayerError, match="exact clipped sums"):
        PerExampleClipper(net, 1.0, exact=True).accumulate(torch.rand(4, 1, 4, 4))
    head = DPHeadLoss(nn.Linear(8, 3))
    clipper = PerExampleClipper(head, 1.0, exact=True)
    clipper.accumulate(torch.rand(4, 8), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ConfigError, match="empty .grad"):
        clipper.accumulate(torch.rand(4, 8), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ConfigError, match="at least 2\\^-64"):
        PerExampleClipper(head, 2.0**-65, exact=True)


class _Embedder(nn.Module):
    """Logit-DP's minimal model: ``Linear(1, 8)`` embeddings (the pair clipper's Jacobian pass
    runs one backward per embedding coordinate)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(1, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b", BATCHES)
def test_pair_sum_under_bf16_stays_within_the_recorded_sensitivity(
    b: int, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The per-example scan for pairs: the loss weights on the diagonal only (as
    test_clipper_sensitivity's single-pair test sets them), so b identical examples add b
    identical clipped pair vectors (second views -x) and the neighbour removes one, a difference
    of B (C scanned at 16 values here, each pass is slower); Logit-DP's
    own Delta is far above it, so B (1 + b ceil(log2 b) 2^-23) is the bound checked."""
    weights = training.dp.pair_clipping._loss_weights

    def diagonal(e: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
        n = e.shape[0] // 2
        return torch.eye(n, dtype=e.dtype, device=e.device), weights(e, tau)[1]

    monkeypatch.setattr(training.dp.pair_clipping, "_loss_weights", diagonal)
    torch.manual_seed(0)
    net = _Embedder().to(device)
    x = torch.rand(1, 1, device=device).expand(b, 1) + 0.5

    def accumulate(batch: torch.Tensor, clip: float) -> None:
        result = PairClipper(net, clip, TAU).accumulate(batch, -batch)
        assert bool((result.factors.diagonal() < 1).all())

    params = list(net.parameters())
    ratio = _worst(accumulate, params, x, _recorded("DP-SGD", b), device, scale=1e-3, every=6)
    print(f"pairs b={b} {device}: worst {ratio:.8f} of B (1 + b ceil(log2 b) 2^-23)")
    assert 0.99 < ratio <= 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("b", BATCHES)
def test_batch_clipped_sum_under_bf16_stays_within_c(b: int, device: str) -> None:
    """Naive-DP clips the whole batch's gradient as computed, so rounding cannot lift it: each
    neighbour's realised sum stays within C (1 + 2^-23), half its recorded
    2C (1 + b ceil(log2 b) 2^-23)."""
    torch.manual_seed(0)
    net = _Embedder().to(device)
    x = torch.rand(b, 1, device=device) + 0.5
    worst = 0.0
    for clip in (c * 1e-3 for c in CLIPS):
        for batch in (x, x[1:]):
            with torch.autocast(device, dtype=torch.bfloat16):
                result = BatchClipper(net, clip, TAU).accumulate(batch, -batch)
            assert float(result.factors) < 1
            worst = max(worst, float(_grad(list(net.parameters())).norm()) / clip)
    params = {"loss": CONTRASTIVE_LOSS, "temperature": TAU}
    assert sensitivity("Naive-DP", 1.0, {**params, ROUNDING_TERMS: b}) >= 2 * worst
    assert 0.99 < worst <= 1 + 2.0**-23


def test_a_bf16_model_is_refused() -> None:
    """A bf16 ``.grad`` would round the clipped sum to 8 bits again: train under autocast."""
    with pytest.raises(ConfigError, match="fp32 or fp64"):
        PerExampleClipper(_Linear().to(torch.bfloat16), 1.0)
    with pytest.raises(ConfigError, match="fp32 or fp64"):
        BatchClipper(_Embedder().half(), 1.0, TAU)


@pytest.mark.parametrize(
    ("terms", "summation", "claimed", "ok"),
    [
        (423, None, 1 + 423 * 9 * 2.0**-23, True),  # the engine's record at n q = 256
        (423, FP32_BLOCKED, 1 + 423 * 9 * 2.0**-23, True),
        (423, None, 1.0, False),  # the allowance recorded but not in the sensitivity
        (100, None, 1 + 100 * 7 * 2.0**-23, False),  # b below what the steps could sum
        (423, FP64_ONCE, 1 + 423 * 2.0**-23 + 424**2 * 2.0**-52, True),  # a DP head's record
        (423, FP64_ONCE, 1.0, False),
        (423, FP64_ONCE, 1 + 423 * 9 * 2.0**-23, False),  # another rule's figure
        (423, "fp16", 1.0, False),  # no such rule
    ],
)
def test_verify_recomputes_the_rounding_allowance(
    terms: int, summation: str | None, claimed: float, ok: bool
) -> None:
    """``verify`` recomputes Delta (1 + b ceil(log2 b) 2^-23) for blocked fp32 sums, Delta (1 +
    b 2^-23 + (b + 1)^2 2^-52) for exact ones, and refuses a b below the stage's sample bound."""
    assert sample_bound(50_000, 256 / 50_000) == 423
    stage = DPStage.from_parameters(
        name="dp",
        dataset=Dataset(name="d", size=50_000),
        mechanism="DP-AdamW",
        sample_rate=256 / 50_000,
        noise_multiplier=1.0,
        steps=10,
        clipping_norm=0.5,
        noised_dimension=1_000,
        sensitivity=0.5 * claimed,
        mechanism_params={
            ROUNDING_TERMS: terms,
            **({} if summation is None else {ROUNDING_SUM: summation}),
        },
    )
    report = VerificationReport()
    _check_mechanisms(PrivacyLedger.build([stage]), report)
    assert report.ok is ok, report.problems


def test_a_summation_rule_without_its_terms_or_beyond_its_proof_is_refused() -> None:
    with pytest.raises(AccountingError, match="without rounding_terms"):
        sensitivity("DP-SGD", 1.0, {ROUNDING_SUM: FP64_ONCE})
    with pytest.raises(AccountingError, match="at most 4194304"):
        sensitivity("DP-SGD", 1.0, {ROUNDING_TERMS: 2**22 + 1, ROUNDING_SUM: FP64_ONCE})
