"""The DP engine: sampling, noise once, division by the expected batch, budget, resume, and the
one-run audit that must catch a run whose noise or clipping is wrong."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError
from support.clipping import empty_step_update
from support.helpers import DEVICES, TINY, staged_reports, synthetic_stage, tiny_encoder

import training.dp.canaries
import training.dp.engine
from training.dp.canaries import DiracCanaries
from training.dp.clipping import PerExampleClipper
from training.dp.engine import EMPTY, Budget, DPEngine
from training.skeleton.distributed import Dist
from vip_hub import Dataset, DPStage, export_encoder
from vip_hub.errors import AccountingError, AuditError, CheckpointError, ConfigError
from vip_hub.privacy.accounting import NOISE_SAMPLER, epsilon
from vip_hub.privacy.audit import ceiling, log_likelihood_ratio
from vip_hub.privacy.sensitivity import FP64_CAPPED, ROUNDING_SUM, sample_bound
from vip_hub.repo.push import push_repo
from vip_hub.repo.verify import verify_repo


class BiasSum(torch.nn.Module):
    """loss_i = sum(W x_i + b): with x_i = 0 each example's gradient is all-ones on the bias."""

    def __init__(self, width: int, device: str = "cpu"):
        super().__init__()
        self.layer = torch.nn.Linear(4, width, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).sum(1)


def engine_for(
    model: torch.nn.Module,
    *,
    n: int,
    batch: int,
    sigma: float | None = None,
    eps: float | None = None,
    steps: int = 10,
    clip: float = 1.0,
    canaries: int = 0,
    micro: int | None = 8,
    seed: int = 0,
    lr: float = 0.0,
    ema_decay: float = 0.0,
) -> DPEngine:
    budget = Budget.plan(
        dataset_size=n,
        batch_size=batch,
        steps=steps,
        epsilon=eps,
        sigma=sigma,
        delta=1e-5,
        accountant="rdp",
    )
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    return DPEngine(
        PerExampleClipper(model, clip),
        optimizer,
        None,
        budget,
        sensitivity=clip,
        clipping_norm=clip,
        seed=seed,
        dist=Dist(device=next(model.parameters()).device),
        micro_batch_size=micro,
        audit_canaries=canaries,
        ema_decay=ema_decay,
    )


def test_every_coordinate_of_every_trained_parameter_gets_noise() -> None:
    """An empty sample's update is noise alone: no released coordinate (the buffer's last
    included) may come out exactly zero, as one left un-noised would."""
    model = BiasSum(16)
    clipper = PerExampleClipper(model, 1.0)
    _, update = empty_step_update(
        clipper, clip=1.0, sensitivity=1.0, sigma=1.0, batch=64, micro_batch_size=8
    )
    assert update.numel() == sum(p.numel() for p in model.parameters())
    assert (update != 0).all(), f"{torch.nonzero(update == 0).flatten().tolist()} got no noise"


def update_of(
    engine: DPEngine, param: torch.nn.Parameter, step: int, micro_batches: list
) -> torch.Tensor:
    """The noisy mean gradient the optimiser receives at ``step``."""
    seen = {}
    engine.optimizer.step = lambda: seen.setdefault("grad", param.grad.clone())  # type: ignore[method-assign]
    engine.step(step, micro_batches)
    return seen["grad"]


@pytest.mark.parametrize("device", DEVICES)
def test_noise_is_sigma_times_sensitivity_over_expected_batch_even_for_an_empty_sample(
    device: str,
) -> None:
    model = BiasSum(200_000, device)
    sigma, clip, batch = 1.3, 0.1, 64
    engine = engine_for(model, n=1000, batch=batch, sigma=sigma, clip=clip)
    update = update_of(
        engine, model.layer.bias, 0, []
    )  # nothing sampled on this rank: still a noisy step
    assert update.std().item() == pytest.approx(sigma * clip / batch, rel=0.01)
    assert abs(update.mean().item()) < 3 * sigma * clip / batch / 200_000**0.5
    assert engine.steps_done == 1 and engine.history == [(sigma, batch / 1000, 1)]


def test_noise_chunks_are_independent_streams_whatever_the_thread_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(training.dp.engine, "NOISE_CHUNK", 1 << 16)
    monkeypatch.setattr(training.dp.engine, "_CPU_NOISE_DRAW", 1 << 12)
    numel, std = 11 << 15, 2.0  # 5.5 chunks of 4,096-coordinate draws
    threads = torch.get_num_threads()

    def noise(step: int, workers: int, base: torch.Tensor | None = None) -> torch.Tensor:
        flat = torch.zeros(numel) if base is None else base.clone()
        torch.set_num_threads(workers)
        try:
            training.dp.engine.add_gaussian_noise(flat, std, 7, step)
        finally:
            torch.set_num_threads(threads)
        return flat

    one, two = noise(3, 1), noise(3, 2)
    torch.testing.assert_close(one, two, rtol=0, atol=0)  # the seed alone decides the noise
    chunks = one.split(1 << 16)
    assert len(chunks) == 6 and len(chunks[-1]) == 1 << 15
    for chunk in chunks:
        assert chunk.std().item() == pytest.approx(std, rel=0.03)
        assert abs(chunk.mean().item()) < 5 * std / len(chunk) ** 0.5
    for a, b in zip(chunks[:-2], chunks[1:-1], strict=True):  # no chunk repeats another's stream
        assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 0.03
    assert not torch.equal(one, noise(4, 2))  # nor one step another's
    base = torch.randn(numel)
    torch.testing.assert_close(noise(3, 2, base) - base, one, rtol=0, atol=1e-5)  # added, in place


def test_the_clipped_sum_is_divided_by_the_expected_batch_not_the_sampled_count() -> None:
    width, clip, batch = 64, 0.5, 10
    model = BiasSum(width)
    engine = engine_for(model, n=20, batch=batch, sigma=1e-9, clip=clip)
    local = engine.plan(0)
    assert 0 < len(local) != batch
    update = update_of(engine, model.layer.bias, 0, [(torch.zeros(len(local), 4),)])
    per_example = clip / width**0.5  # an all-ones gradient of norm sqrt(width), clipped to C
    torch.testing.assert_close(
        update, torch.full((width,), len(local) * per_example / batch), rtol=1e-5, atol=1e-7
    )


def test_sampler_plans_each_step_once_and_its_micro_batches_cover_the_sample(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []
    real = training.dp.engine.poisson_sample
    monkeypatch.setattr(
        training.dp.engine, "poisson_sample", lambda *a, **k: calls.append(a[3]) or real(*a, **k)
    )
    engine = engine_for(BiasSum(4), n=30, batch=2, sigma=1.0, steps=40, micro=2)
    by_step: dict[int, list[int]] = {}
    for part in engine.sampler(0):
        assert 1 <= len(part) <= 2 and len({s for s, _ in part}) == 1
        by_step.setdefault(part[0][0], []).extend(i for _, i in part)
    assert calls[:40] == list(range(40))  # each step's plan drawn once, in order
    assert sorted(by_step) == list(range(40))
    empties = [s for s, items in by_step.items() if items == [EMPTY]]
    assert empties, "at q = 1/15 and n = 30 some steps sample nothing"
    other = engine_for(BiasSum(4), n=30, batch=2, sigma=1.0, steps=40, micro=7)
    for step, items in by_step.items():  # the micro-batch size does not change the sample
        assert items == ([EMPTY] if not len(other.plan(step)) else other.plan(step).tolist())


def test_budget_plan_calibrates_and_stops_within_the_target() -> None:
    b = Budget.plan(
        dataset_size=1000,
        batch_size=50,
        steps=200,
        epsilon=3.0,
        sigma=None,
        delta=1e-5,
        accountant="pld",
    )
    assert (
        b.steps == 200
        and epsilon(b.noise_multiplier, 0.05, 200, 1e-5, "pld") <= 3.0
        and b.stop_message() is None
    )
    b = Budget.plan(
        dataset_size=1000,
        batch_size=50,
        steps=10_000,
        epsilon=3.0,
        sigma=1.0,
        delta=1e-5,
        accountant="rdp",
    )
    assert epsilon(1.0, 0.05, b.steps, 1e-5) <= 3.0 < epsilon(1.0, 0.05, b.steps + 1, 1e-5)
    assert f"stopping after step {b.steps} of 10000" in b.stop_message()
    with pytest.raises(ConfigError, match="batch-size must be in"):
        Budget.plan(
            dataset_size=10,
            batch_size=11,
            steps=1,
            epsilon=1.0,
            sigma=None,
            delta=None,
            accountant="rdp",
        )
    with pytest.raises(ConfigError, match="give --epsilon"):
        Budget.plan(
            dataset_size=10,
            batch_size=1,
            steps=1,
            epsilon=None,
            sigma=None,
            delta=None,
            accountant="rdp",
        )
    with pytest.raises(AccountingError, match="a single step"):
        Budget.plan(
            dataset_size=10,
            batch_size=10,
            steps=5,
            epsilon=0.01,
            sigma=0.5,
            delta=None,
            accountant="rdp",
        )


def test_a_delta_above_one_over_n_is_refused_unless_asked_for(tmp_path: Path) -> None:
    """Recipes and DP heads refuse delta > 1/n unless --allow-weak-delta; verify flags a stage
    above 1/(10n) as weak (an import keeps its paper's delta and is flagged)."""
    from training.recipes.probe import ProbeConfig, fit_probe

    plan = dict(dataset_size=1000, batch_size=10, steps=10, epsilon=None, sigma=1.0)
    with pytest.raises(AccountingError, match="above 1/n .*--allow-weak-delta"):
        Budget.plan(**plan, delta=0.002, accountant="rdp")
    assert Budget.plan(**plan, delta=0.002, accountant="rdp", allow_weak_delta=True).delta == 0.002
    assert Budget.plan(**plan, delta=0.001, accountant="rdp").delta == 0.001  # 1/n itself
    head = dict(encoder="e", data="d", dataset_name="test/d", epsilon=1.0, epochs=1)
    x, y = torch.randn(100, 8), torch.arange(100) % 2
    with pytest.raises(AccountingError, match="--allow-weak-delta"):
        fit_probe(x, y, 2, ProbeConfig(**head, delta=0.02), public_x=torch.randn(10, 8))
    for delta, weak in ((1e-4, False), (1.01e-4, True), (1 / 2000, True)):
        stage = DPStage.from_parameters(
            name="dp-pretraining",
            dataset=Dataset(name="test/weak", size=1000),
            sample_rate=0.01,
            noise_multiplier=1.0,
            steps=10,
            clipping_norm=1.0,
            noised_tensors={"unreleased:test": 1_000},
            delta=delta,
        )
        repo = export_encoder(
            tmp_path / f"r{delta}", tiny_encoder(), TINY, [synthetic_stage(), stage], model_name="r"
        )
        report = verify_repo(repo)
        assert report.ok and stage.weak_delta == weak
        assert any("weak delta" in w for w in report.warnings) == weak, report.warnings


def _train(engine: DPEngine, x: torch.Tensor, start: int, stop: int) -> None:
    for step in range(start, stop):
        idx = engine.plan(step)
        engine.step(step, [(x[idx[i : i + 8]],) for i in range(0, len(idx), 8)])


def test_resume_from_state_gives_the_same_weights_history_and_audit_scores() -> None:
    x = torch.randn(40, 4)
    torch.manual_seed(1)
    whole = BiasSum(6)
    torch.manual_seed(1)
    halves = BiasSum(6)
    a = engine_for(whole, n=40, batch=8, sigma=0.8, steps=6, canaries=50, lr=0.1)
    _train(a, x, 0, 6)
    b = engine_for(halves, n=40, batch=8, sigma=0.8, steps=6, canaries=50, lr=0.1)
    _train(b, x, 0, 3)
    state, weights = b.state_dict(), {k: v.clone() for k, v in halves.state_dict().items()}
    torch.manual_seed(1)
    resumed_model = BiasSum(6)
    resumed_model.load_state_dict(weights)
    resumed = engine_for(resumed_model, n=40, batch=8, sigma=0.8, steps=6, canaries=50, lr=0.1)
    resumed.load_state_dict(state)
    _train(resumed, x, 3, 6)
    assert resumed.history == a.history == [(0.8, 0.2, 6)]
    assert all(
        torch.equal(p, q)
        for p, q in zip(
            whole.state_dict().values(), resumed_model.state_dict().values(), strict=True
        )
    )
    np.testing.assert_array_equal(resumed.canaries.scores, a.canaries.scores)
    other = engine_for(BiasSum(6), n=40, batch=8, sigma=0.9, steps=6)
    with pytest.raises(CheckpointError, match="does not match.*pass --restart"):
        other.load_state_dict(state)
    with pytest.raises(RuntimeError, match="out of order"):
        resumed.step(2, [])


def test_the_average_is_the_iterates_moving_average_and_leaves_the_training_alone() -> None:
    """``ema_decay`` d: a <- d a + (1 - d) w after each step, from the initial weights; the
    iterates (the noise, the sample) are those of a run without it; its decay is recorded."""
    x, d = torch.randn(40, 4), 0.7
    models, engines = [], []
    for decay in (0.0, d):
        torch.manual_seed(1)
        models.append(BiasSum(6))
        engines.append(
            engine_for(models[-1], n=40, batch=8, sigma=0.8, steps=6, lr=0.1, ema_decay=decay)
        )
    plain, averaging = engines
    expected = [p.detach().clone() for p in models[1].parameters()]
    for step in range(6):
        _train(plain, x, step, step + 1)
        _train(averaging, x, step, step + 1)
        for e, p, q in zip(expected, models[0].parameters(), models[1].parameters(), strict=True):
            assert torch.equal(p, q)  # averaging is post-processing: the same iterates
            e.mul_(d).add_(p.detach(), alpha=1 - d)
    last = [p.detach().clone() for p in models[1].parameters()]
    with averaging.averaged():
        for e, p, w in zip(expected, models[1].parameters(), last, strict=True):
            torch.testing.assert_close(p.detach(), e, rtol=1e-6, atol=1e-7)
            assert not torch.equal(p.detach(), w)
    assert all(torch.equal(p, w) for p, w in zip(models[1].parameters(), last, strict=True))
    averaging.use_average()
    assert all(
        torch.equal(p.detach(), a)
        for p, a in zip(models[1].parameters(), averaging.average or [], strict=True)
    )
    stage = averaging.stage(
        audit_delta=1e-5,
        released={"unreleased": models[1]},
        name="dp-averaged",
        dataset=Dataset(name="audit-data", size=40),
        mechanism="DP-SGD",
        hyperparameters={"lr": 0.1},
    )
    assert stage.hyperparameters == {"lr": 0.1, "ema_decay": d}
    assert plain.average is None and "average" not in plain.state_dict()
    with pytest.raises(ConfigError, match="ema-decay must be in"):
        engine_for(BiasSum(6), n=40, batch=8, sigma=0.8, ema_decay=1.0)


def test_a_resumed_run_ends_with_the_same_average() -> None:
    x = torch.randn(40, 4)
    torch.manual_seed(1)
    whole = engine_for(BiasSum(6), n=40, batch=8, sigma=0.8, steps=6, lr=0.1, ema_decay=0.6)
    _train(whole, x, 0, 6)
    torch.manual_seed(1)
    halves = BiasSum(6)
    first = engine_for(halves, n=40, batch=8, sigma=0.8, steps=6, lr=0.1, ema_decay=0.6)
    _train(first, x, 0, 3)
    state, weights = first.state_dict(), {k: v.clone() for k, v in halves.state_dict().items()}
    resumed_model = BiasSum(6)
    resumed_model.load_state_dict(weights)
    resumed = engine_for(resumed_model, n=40, batch=8, sigma=0.8, steps=6, lr=0.1, ema_decay=0.6)
    resumed.load_state_dict(state)
    _train(resumed, x, 3, 6)
    assert whole.average is not None and resumed.average is not None
    assert all(torch.equal(a, b) for a, b in zip(whole.average, resumed.average, strict=True))


@pytest.mark.parametrize("sampler", [None, "numpy float64 ziggurat", "a later sampler"])
def test_a_checkpoint_of_another_noise_sampler_is_refused(sampler: str | None) -> None:
    """Issue 52: a checkpoint written before the noise moved to Philox on the device (its engine
    state names no sampler: numpy's ziggurat drew its steps) cannot continue under the new
    streams, since one stage records one sampler's support: refused, naming --restart."""
    engine = engine_for(BiasSum(6), n=40, batch=8, sigma=0.8, steps=6)
    _train(engine, torch.randn(40, 4), 0, 2)
    state = engine.state_dict()
    assert state["noise_sampler"] == NOISE_SAMPLER
    if sampler is None:
        del state["noise_sampler"]
    else:
        state["noise_sampler"] = sampler
    resumed = engine_for(BiasSum(6), n=40, batch=8, sigma=0.8, steps=6)
    with pytest.raises(CheckpointError, match="--restart") as refused:
        resumed.load_state_dict(state)
    assert f"its 2 steps drew their noise from the {sampler or 'numpy float64 ziggurat'}" in str(
        refused.value
    )
    assert resumed.steps_done == 0


@pytest.mark.parametrize("summation", [None, "fp32-blocked"])
def test_a_checkpoint_of_another_summation_rule_is_refused(summation: str | None) -> None:
    """Issue 52: a checkpoint whose steps formed their clipped sums in fp32 (no rule recorded:
    ``fp32-blocked``, a model) cannot continue under the proved ``fp64-capped``, since one stage
    records one rule: refused, naming --restart."""
    engine = engine_for(BiasSum(6), n=40, batch=8, sigma=0.8, steps=6)
    _train(engine, torch.randn(40, 4), 0, 2)
    state = engine.state_dict()
    assert state[ROUNDING_SUM] == FP64_CAPPED
    if summation is None:
        del state[ROUNDING_SUM]
    else:
        state[ROUNDING_SUM] = summation
    resumed = engine_for(BiasSum(6), n=40, batch=8, sigma=0.8, steps=6)
    with pytest.raises(CheckpointError, match="--restart") as refused:
        resumed.load_state_dict(state)
    assert "its 2 steps formed their clipped sums by the rule fp32-blocked" in str(refused.value)
    assert resumed.steps_done == 0


# ------------------------------------------------------------------ the audit must be able to fail
AUDITED = dict(n=1000, batch=100, eps=2.0, steps=100, canaries=1000, micro=64)


def audited_stage(
    monkeypatch: pytest.MonkeyPatch | None = None,
    *,
    noise_scale: float = 1.0,
    bypass_clipping: bool = False,
):  # type: ignore[no-untyped-def]
    """A 100-step run claiming epsilon 2 (RDP, delta 1e-5) with 1000 canaries; optionally with
    its noise secretly scaled (the accountant still told sigma) or its canaries left unclipped."""
    if noise_scale != 1.0:
        real = training.dp.engine.add_gaussian_noise
        monkeypatch.setattr(
            training.dp.engine,
            "add_gaussian_noise",
            lambda flat, std, seed, step: real(flat, std * noise_scale, seed, step),
        )
    if bypass_clipping:
        monkeypatch.setattr(
            training.dp.canaries, "clip_factors", lambda norms, c: torch.ones_like(norms)
        )
    torch.manual_seed(0)
    model = BiasSum(8)
    engine = engine_for(model, **AUDITED)
    _train(engine, torch.randn(1000, 4), 0, engine.budget.steps)
    return engine.stage(
        audit_delta=1e-5,
        released={"unreleased": model},
        name="dp-audited",
        dataset=Dataset(name="audit-data", size=1000),
        mechanism="DP-SGD",
    )


@pytest.fixture(scope="module")
def honest():  # type: ignore[no-untyped-def]
    return audited_stage()


def test_an_honest_run_proves_less_than_it_claims(honest) -> None:  # type: ignore[no-untyped-def]
    a = honest.audit
    assert honest.epsilon <= 2.0 and a.delta == 1e-5 and a.canaries == 1000
    # d counts the noised tensors, named where they are released, and the canaries
    assert honest.noised_tensors == {
        "unreleased:layer.weight": 32,
        "unreleased:layer.bias": 8,
        "canaries": 1000,
    }
    assert honest.noised_dimension == 1040
    assert [r.guesses for r in a.results] == [20, 50, 100, 200, 500, 1000]
    assert 0 < a.epsilon_lower_bound < 2.0 and a.epsilon_lower_bound < min(
        a.accountant_epsilon.values()
    )
    assert (
        a.ceiling == pytest.approx(ceiling(1000, 0.05, 1e-5), abs=1e-6) and a.can_fail
    )  # 5.27 > 2


def test_canaries_are_drawn_by_the_engine_sampler_with_the_examples(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []
    real = training.dp.engine.poisson_sample
    monkeypatch.setattr(
        training.dp.engine, "poisson_sample", lambda *a: calls.append(a) or real(*a)
    )
    engine = engine_for(BiasSum(4), n=30, batch=6, sigma=1e-6, steps=3, canaries=40)
    members = engine.canaries.members
    assert set(members) == set(np.flatnonzero(engine.canaries.secrets)) and 0 < len(members) < 40
    seen = []
    monkeypatch.setattr(engine.canaries, "observe", lambda block, sigma: seen.append(block.clone()))
    for step in range(3):
        examples = engine.plan(step)
        calls.clear()
        engine.step(step, [(torch.zeros(len(examples), 4),)])
        assert [c[:4] for c in calls] == [
            (30 + len(members), 0.2, 0, step)
        ]  # one population, one stream
        drawn = real(30 + len(members), 0.2, 0, step)
        np.testing.assert_array_equal(examples, drawn[drawn < 30])
        sampled = members[drawn[drawn >= 30] - 30]
        np.testing.assert_allclose(
            seen[-1].numpy(), np.isin(np.arange(40), sampled).astype(np.float32), atol=1e-4
        )


def test_a_step_past_the_sample_bound_stops_before_its_update() -> None:
    """The recorded sensitivity covers the rounding of sums of at most ``sample_bound(n, q)``
    examples: a step that sums more (a chance below 2^-64, or a bug upstream) must not update."""
    model = BiasSum(4)
    engine = engine_for(model, n=100_000, batch=100, sigma=1.0, steps=3, lr=1.0, micro=None)
    bound = sample_bound(100_000, 0.001)
    assert engine.max_sample == bound < 100_000
    before = model.layer.bias.detach().clone()
    with pytest.raises(
        AccountingError, match=f"sampled {bound + 1} examples, more than the {bound}"
    ):
        engine.step(0, [(torch.zeros(bound, 4),), (torch.zeros(1, 4),)])
    assert torch.equal(model.layer.bias, before) and engine.steps_done == 0


@pytest.mark.parametrize("seed", [0, 1, 2**127 + 7])
def test_each_canary_is_a_member_with_probability_one_half(seed: int) -> None:
    """The audit's bound assumes each canary's bit is a fair coin: over 20,000 canaries the
    members are 10,000 give or take 4.5 standard deviations (71 each)."""
    canaries = DiracCanaries(20_000, 0.1, seed, 1.0, 1.0, owner=True)
    assert abs(len(canaries.members) - 10_000) < 4.5 * 71


def test_a_canarys_score_reads_its_coordinate_in_units_of_the_stated_sensitivity() -> None:
    """A clipper bounding a canary at 2 sensitivities adds 2 to its coordinate: the score must
    read that y = 2 against the stated unit, the excess the audit exists to see."""
    canaries = DiracCanaries(3, 0.1, 0, sensitivity=0.5, bound=1.0, owner=True)
    canaries.observe(torch.tensor([1.0, 0.5, 0.0], dtype=torch.float64), noise_multiplier=2.0)
    expected = log_likelihood_ratio(np.array([2.0, 1.0, 0.0]), 0.1, 2.0)
    np.testing.assert_allclose(canaries.scores, expected, rtol=1e-12)


def test_noise_secretly_scaled_down_is_caught_by_verify_and_the_hub(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from support.live import WRITE_TOKEN, ThreadedServer, settings_for

    stage = audited_stage(monkeypatch, noise_scale=0.1)
    assert stage.epsilon <= 2.0 < stage.audit.epsilon_lower_bound  # the claim is what it was told
    stages = [synthetic_stage(), stage]
    with pytest.raises(AuditError, match="exceeds the accounted epsilon"):  # the export's check
        export_encoder(tmp_path / "leaky", tiny_encoder(), TINY, stages, model_name="leaky")
    assert not (tmp_path / "leaky").exists()
    staged_reports(monkeypatch)  # written past that check, for verify, push and the hub
    repo = export_encoder(tmp_path / "leaky", tiny_encoder(), TINY, stages, model_name="leaky")
    report = verify_repo(repo)
    assert not report.ok and any(
        p.kind is AuditError and "exceeds the accounted epsilon" in p.message
        for p in report.problems
    )
    with pytest.raises(AuditError):
        report.raise_for_problems()
    with pytest.raises(AuditError):  # vip-hub push checks before sending anything
        push_repo(repo, "vip/leaky", endpoint="http://127.0.0.1:9", token=WRITE_TOKEN)
    with ThreadedServer(
        settings_for(tmp_path / "store")
    ) as server:  # the unmodified client: the hub refuses
        api = HfApi(endpoint=server.url, token=WRITE_TOKEN)
        api.create_repo("vip/leaky")
        with pytest.raises(HfHubHTTPError, match="exceeds the accounted epsilon"):
            api.upload_folder(folder_path=repo, repo_id="vip/leaky")


def test_canaries_left_unclipped_give_a_higher_bound(
    monkeypatch: pytest.MonkeyPatch, honest
) -> None:  # type: ignore[no-untyped-def]
    stage = audited_stage(monkeypatch, bypass_clipping=True)
    assert stage.audit.epsilon_lower_bound > 2 * honest.audit.epsilon_lower_bound


def test_canaries_are_clipped_to_the_clippers_own_bound_not_the_stated_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A clipper that clips to 2C while the ledger states C (the bug the audit must see): each
    sampled canary adds 2 sensitivities to its coordinate, not the 1 a canary clipped to the
    stated bound would add, so the audit scores the excess the examples get."""
    model = BiasSum(4)
    budget = Budget.plan(
        dataset_size=30,
        batch_size=6,
        steps=3,
        epsilon=None,
        sigma=1e-6,
        delta=1e-5,
        accountant="rdp",
    )
    engine = DPEngine(
        PerExampleClipper(model, 2.0),  # clips to twice what it states
        torch.optim.SGD(model.parameters(), lr=0.0),
        None,
        budget,
        sensitivity=1.0,
        clipping_norm=1.0,
        seed=0,
        dist=Dist(device=torch.device("cpu")),
        micro_batch_size=8,
        audit_canaries=40,
    )
    seen = []
    monkeypatch.setattr(engine.canaries, "observe", lambda block, sigma: seen.append(block.clone()))
    for step in range(3):
        engine.step(step, [(torch.zeros(len(engine.plan(step)), 4),)])
    block = torch.stack(seen)
    sampled = block > 0.5
    assert int(sampled.sum()) > 0
    torch.testing.assert_close(
        block[sampled], torch.full_like(block[sampled], 2.0), atol=1e-4, rtol=0
    )
    assert float(block[~sampled].abs().max()) < 1e-4
