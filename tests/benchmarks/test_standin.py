"""Settings chosen on public data only (issue 54, point 1), structurally:

- ``benchmarks/standin.py``, the tool that tries the study's DP settings on a public stand-in,
  reads the public test split alone (a spy on its data loader, and no training split on disk), and
  reproduces the real run's noise: the DP encoder stage at the real run's noise multiplier, the
  heads with the real head's noise on their averaged gradient;
- the study's feature-mode choice (``training.study.selection.choose_modes``) is given the
  private records but reads nothing of them but their number and declared name: a spy that
  refuses every other attribute stands in for them."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch
from support.helpers import dp_stage, load_benchmark, write_idx

from training.data.labelled import FASHION_MNIST_TEST, FASHION_MNIST_TRAIN, fashion_mnist
from training.priors import prior_path
from training.recipes.probe import fit_probe
from training.study.config import BENCHMARK, JOB, StudyConfig
from training.study.selection import choose_modes
from vip_hub.loading import load_encoder
from vip_hub.privacy.accounting import calibrate, composed_epsilon
from vip_hub.privacy.ledger import Dataset, PrivacyLedger
from vip_hub.repo_format import LEDGER_FILE

load_benchmark("utility")  # standin reads the fine-tuning row's settings from it
standin = load_benchmark("standin")

PRIVATE, END = 40, 60
"""The tiny stand-in: test records 0-39 play the private records, 40-59 score."""
TINY = StudyConfig(
    **{
        **JOB.model_dump(),
        "train_size": 200,
        "centre_size": 10,
        "select_size": 20,
        "test_size": 20,
        "probe_epochs": 2,
        "dp_batch_size": 8,
        "dp_steps": 2,
        "dp_micro_batch_size": 8,
        "dp_ema_decay": 0.5,
        "decoder_dim": 32,
        "decoder_depth": 1,
        "decoder_heads": 2,
        "head_kind": "sgd",
    }
)
"""The job's study at a tiny scale: its real run has 200 private records, 2-step encoders (which
release their iterates' average) and 2-epoch heads."""


@pytest.fixture(scope="module")
def public_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Fashion-MNIST folder with the test split only: reading the train split fails."""
    folder = tmp_path_factory.mktemp("fmnist-test-only")
    write_idx(folder, "t10k", END + 20, 3)
    return folder


def test_standin_reads_the_public_test_split_only_and_matches_the_real_noise(
    public_only: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[str] = []

    def spy(split: str, *args: Any, **kwargs: Any) -> Any:
        asked.append(split)
        return fashion_mnist(split, *args, **kwargs)

    monkeypatch.setattr(standin, "fashion_mnist", spy)
    recs = standin.standin_records(TINY, str(public_only), tmp_path, PRIVATE, END)
    assert asked == ["test"]
    assert recs.private.dataset.name == recs.score.dataset.name == FASHION_MNIST_TEST
    assert (len(recs.private), len(recs.score), len(recs.centre)) == (40, 20, 10)
    with pytest.raises(Exception, match="t10k|train"):
        fashion_mnist("train", public_only)  # nothing private on disk to read

    t = standin.heads_trial(TINY, "vip", {"E": 1.0}, recs, tmp_path / "work", heads=1)
    assert asked == ["test"]
    # the stand-in's DP stage: the real run's sigma and steps at the real batch, on public data
    sigma, q, steps = standin.encoder_stage(TINY, "vip")
    assert q == TINY.dp_batch_size / TINY.train_size and steps == TINY.dp_steps
    assert t.real["encoder"] == (sigma, q, steps)
    repo = next((tmp_path / "work").glob("vip-*/" + LEDGER_FILE)).parent
    stages = PrivacyLedger.parse((repo / LEDGER_FILE).read_text()).dp_stages()
    assert [(s.dataset.name, s.dataset.size) for s in stages] == [(FASHION_MNIST_TEST, PRIVATE)]
    assert stages[0].noise_multiplier == pytest.approx(sigma)
    assert stages[0].sample_rate == pytest.approx(TINY.dp_batch_size / PRIVATE)
    assert stages[0].steps == steps
    assert stages[0].hyperparameters["ema_decay"] == TINY.dp_ema_decay  # the study's, released
    # the heads: the real head's draws compose with the encoder to the budget; the stand-in's
    # keeps q and T, its sigma scaled by the ratio of expected batches (the same noise on the
    # average)
    real_head, standin_head = t.real["head"], t.standin["head"]
    draws = [real_head] * TINY.head_draws
    composed = composed_epsilon([t.real["encoder"], *draws], TINY.delta)
    assert TINY.epsilon - 0.01 < composed <= TINY.epsilon
    assert standin_head[1:] == real_head[1:]
    ratio = -(-PRIVATE // TINY.head_batches) / -(-TINY.train_size // TINY.head_batches)
    assert standin_head[0] == pytest.approx(real_head[0] * ratio)
    assert len(t.dp_top1) == 1 and 0 <= t.dp_top1[0] <= 100
    # the DP heads read the study's public components, the reference the features
    widths: list[int] = []

    def fit_spy(x: Any, *args: Any, **kwargs: Any) -> Any:
        widths.append(x.shape[1])
        return fit_probe(x, *args, **kwargs)

    monkeypatch.setattr(standin, "fit_probe", fit_spy)
    study = TINY.model_copy(update={"head_components": 4})
    t = standin.heads_trial(study, "syn", {}, recs, tmp_path / "work", heads=1)
    # one DP head, the mean of the study's draws, on the components; the reference the features
    draws = study.head_draws
    assert widths[:draws] == [4] * draws and widths[draws] > 4 and len(t.dp_top1) == 1
    # each prior row reads its family's committed prior
    loaded: list[Path] = []

    def load_spy(repo: Path, *args: Any, **kwargs: Any) -> Any:
        loaded.append(Path(repo))
        return load_encoder(repo, *args, **kwargs)

    monkeypatch.setattr(standin, "load_encoder", load_spy)
    for row in ("syn", "syn-dpcap"):
        standin.heads_trial(TINY, row, {}, recs, tmp_path / "work", heads=1)
    assert loaded == [prior_path(TINY.syn_prior), prior_path(TINY.dpcap_prior)]


def test_a_class_means_trial_centres_apart_and_matches_the_real_one_step_noise(
    public_only: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--disjoint-centre``: the centring records are the last ``centre_size`` of the first
    ``private``, none of them private; a class-means head's real stage is one step on every
    record (q = 1) composing to the budget, and the stand-in's sigma is scaled by the ratio of
    the records (the same noise on each class mean)."""
    recs = standin.standin_records(TINY, str(public_only), tmp_path, PRIVATE, END, True)
    assert (len(recs.private), len(recs.score), len(recs.centre)) == (30, 20, 10)
    assert (
        recs.centre.images.tobytes() == fashion_mnist("test", public_only).images[30:40].tobytes()
    )
    fitted: list[tuple[int, int]] = []
    fit = standin.fit_class_means

    def fit_spy(x: Any, y: Any, classes: int, cfg: Any, public: Any) -> Any:
        fitted.append((len(x), len(public)))
        return fit(x, y, classes, cfg, public)

    monkeypatch.setattr(standin, "fit_class_means", fit_spy)
    study = TINY.model_copy(update={"head_kind": "class-means", "class_means_components": 4})
    t = standin.heads_trial(study, "syn", {}, recs, tmp_path / "work", heads=2)
    assert fitted == [(30, 10)] * 2 * study.head_draws and len(t.dp_top1) == 2  # means of draws
    (sigma, q, steps), standin_head = t.real["head"], t.standin["head"]
    assert (q, steps) == (1.0, 1) and standin_head[1:] == (1.0, 1)
    composed = composed_epsilon([(sigma, q, steps)] * TINY.head_draws, TINY.delta)
    assert TINY.epsilon - 0.01 < composed <= TINY.epsilon  # the real head's draws together
    assert standin_head[0] == pytest.approx(sigma * 30 / TINY.train_size)


def test_the_probe_only_trial_runs_the_dp_sgd_probe_under_the_studys_choice(
    public_only: Path, tmp_path: Path
) -> None:
    """``finetune --probe-only`` on the study's own preset (``head_kind`` ``chosen``): the row's
    probe is a DP-SGD head, so the trial fixes that kind rather than asking for a choice."""
    recs = standin.standin_records(TINY, str(public_only), tmp_path, PRIVATE, END)
    study = TINY.model_copy(update={"head_kind": "chosen"})
    t = standin.finetune_trial(study, {}, recs, tmp_path / "work", probe_only=True)
    assert t.row == "finetune" and len(t.dp_top1) == 3
    assert t.real["head"][1:] == standin.head_sampling(TINY, TINY.train_size, FASHION_MNIST_TEST)


class PrivateSpy:
    """Private records that give their number, declared name and class names (public), and
    refuse anything else: their images and labels."""

    def __init__(self, n: int, classes: tuple[str, ...]):
        self.n, self.classes = n, classes
        self.dataset = Dataset(name=FASHION_MNIST_TRAIN, size=n, description="private")

    def __len__(self) -> int:
        return self.n

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the choice read the private records' {name}")


def test_the_feature_mode_choice_reads_no_private_record(
    public_only: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nor does the head's choice (the study's ``chosen``): each kind scored, the higher kept;
    a (Syn) encoder's choice is made for the noisiest head that reads it (after the DP stage of
    the encoder trained from it, not the (Syn) encoder's own)."""
    from training.study import selection as study_selection

    selection = fashion_mnist("test", public_only).first(40)
    prior = prior_path(TINY.syn_prior)
    private = PrivateSpy(TINY.train_size, selection.classes)
    study = TINY.model_copy(update={"head_kind": "chosen", "class_means_components": 4})
    stage = dp_stage(TINY.train_size, batch=25, sigma=3.0, steps=10)
    spent: list[list[Any]] = []
    choose = study_selection.choose_features
    monkeypatch.setattr(
        study_selection,
        "choose_features",
        lambda cfg, feats, records, private, prior=(): (
            spent.append(list(prior)) or choose(cfg, feats, records, private, prior)
        ),
    )
    readers = {prior: [[], [stage]]}
    chosen = choose_modes(study, readers, selection, private)  # type: ignore[arg-type]
    assert spent == [[stage]]
    assert chosen[prior].mode in chosen[prior].scores
    kinds = chosen[prior].head_scores
    assert (
        set(kinds) == {"sgd", "class-means"}
        and kinds["sgd"] == chosen[prior].scores[chosen[prior].mode]
    )
    assert chosen[prior].head == max(kinds, key=lambda k: kinds[k])
    with pytest.raises(AssertionError, match="images"):
        private.images  # noqa: B018 (the spy refuses what the choice must not read)


def test_the_fine_tuning_trial_matches_the_real_noise_and_exports_nothing(
    public_only: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stand-in's fine-tuning: its sigmas are the real run's scaled by the ratio of expected
    batches (at the real scale so small that the truncation term of delta reaches 1, which no
    ledger may state): the trial trains and scores, and writes no repo."""
    import training.recipes.finetune as finetune

    budgets: list[Any] = []

    class Spy(finetune.DPRun):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            budgets.append(self.budget)

    monkeypatch.setattr(finetune, "DPRun", Spy)
    recs = standin.standin_records(TINY, str(public_only), tmp_path, PRIVATE, END)
    t = standin.finetune_trial(TINY, {"steps": 2}, recs, tmp_path / "work")
    assert [b.noise_multiplier for b in budgets] == [
        pytest.approx(t.standin["finetune"][0], rel=1e-3)
    ]
    ratio = -(-PRIVATE // TINY.head_batches) / -(-TINY.train_size // TINY.head_batches)
    for part in ("probe", "finetune"):
        assert t.standin[part][0] == pytest.approx(t.real[part][0] * ratio)
        assert t.standin[part][1:] == t.real[part][1:]
    run = next((tmp_path / "work").glob("finetune-*"))
    probe = finetune.DPStage.model_validate_json(
        torch.load(run / "finetuned.run" / "probe.pt")["stage"]
    )
    assert probe.noise_multiplier == pytest.approx(t.standin["probe"][0], rel=1e-3)
    assert not (run / "finetuned").exists() and len(t.dp_top1) == 1
    assert 0 <= t.dp_top1[0] <= 100


def test_an_option_past_its_study_fields_bound_is_named(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        standin.main(["vip", "--lr-scale", "100"])
    assert "dp_lr_scale" in capsys.readouterr().err


def test_head_epochs_and_batches_set_the_heads_real_sampling_and_are_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[StudyConfig, dict[str, Any]]] = []

    def trial_spy(study: StudyConfig, row: str, settings: dict[str, Any], *args: Any) -> Any:
        seen.append((study, settings))
        return standin.Trial(row, settings, dp_top1=[50.0])

    def finetune_spy(study: StudyConfig, settings: dict[str, Any], *args: Any) -> Any:
        seen.append((study, settings))
        return standin.Trial("finetune", settings, dp_top1=[50.0])

    monkeypatch.setattr(standin, "standin_records", lambda *args, **kwargs: None)
    monkeypatch.setattr(standin, "heads_trial", trial_spy)
    monkeypatch.setattr(standin, "finetune_trial", finetune_spy)
    standin.main(["syn", "--study", "benchmark", "--head-epochs", "25", "--work", str(tmp_path)])
    standin.main(["syn", "--work", str(tmp_path)])
    standin.main(["syn", "--head-batches", "4", "--mode", "avg", "--work", str(tmp_path)])
    argv = ["finetune", "--head-batches", "4", "--head-epochs", "25", "--work", str(tmp_path)]
    standin.main(argv)
    (given, settings), (default, default_settings), (quarters, quarters_settings), tuned = seen
    # the fine-tuning row's probe and stage: the benchmark's study with both replaced, recorded
    assert tuned[0] == BENCHMARK.updated({"head_batches": 4, "probe_epochs": 25})
    assert (tuned[1]["head_batches"], tuned[1]["head_epochs"]) == (4, 25)
    assert given.probe_epochs == settings["head_epochs"] == 25
    assert default.probe_epochs == default_settings["head_epochs"] == JOB.probe_epochs
    assert default.head_batches == default_settings["head_batches"] == JOB.head_batches
    # a mode other than the default is recorded (and so names the trial's encoder folder)
    assert "mode" not in default_settings and quarters_settings["mode"] == "avg"
    assert quarters.head_batches == quarters_settings["head_batches"] == 4 != JOB.head_batches
    # the real head's q and steps follow the epochs and batches (its noise is calibrated at them)
    for study, epochs, batches in (
        (given, 25, BENCHMARK.head_batches),
        (quarters, JOB.probe_epochs, 4),
    ):
        q, steps = standin.head_sampling(study, study.train_size, FASHION_MNIST_TEST)
        assert (q, steps) == (1 / batches, epochs * batches)
        real, on_standin = standin.matched_head(study, study.train_size, [], 3_000)
        assert real[1:] == on_standin[1:] == (q, steps)
    for bad in (["--head-epochs", "0"], ["--head-batches", "0"]):
        with pytest.raises(SystemExit):  # a bound of the study's field, named
            standin.main(["syn", *bad, "--work", str(tmp_path)])


@pytest.mark.parametrize("row, mechanism", [("naive-dp", "Naive-DP"), ("logit-dp", "Logit-DP")])
def test_a_contrastive_stage_runs_at_the_jobs_contrastive_noise(
    public_only: Path, tmp_path: Path, row: str, mechanism: str
) -> None:
    study = TINY.model_copy(update={"contrastive_batch_size": 4, "contrastive_steps": 2})
    recs = standin.standin_records(study, str(public_only), tmp_path, PRIVATE, END)
    t = standin.heads_trial(study, row, {"E": 0.5}, recs, tmp_path / "work", heads=1)
    sigma, q, steps = standin.encoder_stage(study, row)
    assert (q, steps) == (4 / study.train_size, 2) and t.real["encoder"] == (sigma, q, steps)
    assert sigma == pytest.approx(calibrate(study.encoder_epsilon, study.delta, q, steps))
    assert t.standin["encoder"] == pytest.approx((sigma, 4 / PRIVATE, 2))
    # the stand-in's stage: the family's mechanism at the real sigma, from the (Syn)-ViP prior
    repo = next((tmp_path / "work").glob(f"{row}-*/" + LEDGER_FILE)).parent
    ledger = PrivacyLedger.parse((repo / LEDGER_FILE).read_text())
    (stage,) = ledger.dp_stages()
    assert (stage.mechanism, stage.steps) == (mechanism, 2)
    assert stage.noise_multiplier == pytest.approx(sigma)
    assert stage.sample_rate == pytest.approx(4 / PRIVATE)
    assert stage.dataset.name == FASHION_MNIST_TEST and len(t.dp_top1) == 1

    # its frozen patch embedding is the (Syn)-ViP prior's, as in the job
    def embedding(source: Path) -> torch.Tensor:
        return load_encoder(source).model.patch_embed.proj.weight

    assert torch.equal(embedding(repo), embedding(prior_path(study.syn_prior)))
    assert not torch.equal(embedding(repo), embedding(prior_path(study.dpcap_prior)))


def test_a_matched_rate_stage_samples_the_real_q_at_the_real_noise_on_its_mean(
    public_only: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``matched_rate``: the stand-in's stage samples the real q (a batch of P q: as many epochs
    as the real stage) at sigma scaled by the ratio of the expected batches (sigma / B kept),
    inside ``trial_weights``: nothing exported, the heads read the weights it trained."""
    study = TINY.model_copy(update={"contrastive_batch_size": 50, "contrastive_steps": 2})
    recs = standin.standin_records(study, str(public_only), tmp_path, PRIVATE, END)
    ran, train_encoder = [], standin.train_encoder

    def recorded(stage_study: StudyConfig, row: str, sigma: float, *args: Any) -> Path:
        ran.append((stage_study.contrastive_batch_size, sigma))
        return train_encoder(stage_study, row, sigma, *args)

    monkeypatch.setattr(standin, "train_encoder", recorded)
    t = standin.heads_trial(
        study, "naive-dp", {"rate": "matched"}, recs, tmp_path / "work", 1, matched_rate=True
    )
    sigma, q, steps = t.real["encoder"]
    batch = round(q * PRIVATE)  # 50 of 200 real records: 10 of the stand-in's 40
    assert (q, batch) == (50 / 200, 10) and ran == [(batch, pytest.approx(sigma * batch / 50))]
    assert t.standin["encoder"] == pytest.approx((sigma * batch / 50, q, steps))
    assert not list((tmp_path / "work").glob("naive-dp-*/" + LEDGER_FILE)) and t.dp_top1


def _weights_spied(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    """The weights each embedding of a trial read, and those each ``trial_weights`` kept."""
    read: list[dict[str, torch.Tensor]] = []
    kept: list[dict[str, torch.Tensor]] = []
    embed, trial_weights = standin.embed, standin.trial_weights

    def embed_spy(encoder: Any, *args: Any) -> Any:
        read.append({k: v.clone() for k, v in encoder.model.state_dict().items()})
        return embed(encoder, *args)

    @contextlib.contextmanager
    def trial_spy() -> Any:
        with trial_weights() as weights:
            kept.append(weights)
            yield weights

    monkeypatch.setattr(standin, "embed", embed_spy)
    monkeypatch.setattr(standin, "trial_weights", trial_spy)
    return read, kept


def test_interpolate_moves_the_stages_weights_toward_its_prior(
    public_only: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--interpolate A``: the heads read prior + A (stage - prior), every floating tensor."""
    recs = standin.standin_records(TINY, str(public_only), tmp_path, PRIVATE, END)
    read, kept = _weights_spied(monkeypatch)
    settings = {"noise": "none", "interpolate": 0.25}
    standin.heads_trial(
        TINY, "vip", settings, recs, tmp_path / "work", heads=1, noise=False, interpolate=0.25
    )
    prior = load_encoder(prior_path(TINY.syn_prior)).model.state_dict()
    trained = [k for k, v in prior.items() if v.is_floating_point()]
    moved = [k for k in trained if not torch.equal(kept[0][k], prior[k])]
    assert moved
    for k in moved:
        expected = prior[k] + 0.25 * (kept[0][k] - prior[k])
        assert torch.allclose(read[0][k], expected, atol=1e-6), k


def test_the_adamw_stages_options_are_refused_for_a_contrastive_row(
    capsys: pytest.CaptureFixture[str],
) -> None:
    adamw = (["--lr-scale", "1"], ["--ema-decay", "0"], ["--encoder-parameters", "all"])
    for option in (*adamw, ["--decoder-warmup", "5"]):
        with pytest.raises(SystemExit):
            standin.main(["logit-dp", *option])
        assert "contrastive stages" in capsys.readouterr().err


def test_a_split_other_than_the_default_is_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[dict[str, Any]] = []

    def trial_spy(study: StudyConfig, row: str, settings: dict[str, Any], *args: Any) -> Any:
        seen.append(settings)
        return standin.Trial(row, settings, dp_top1=[50.0])

    monkeypatch.setattr(standin, "standin_records", lambda *args, **kwargs: None)
    monkeypatch.setattr(standin, "heads_trial", trial_spy)
    standin.main(["syn", "--work", str(tmp_path)])
    standin.main(["syn", "--private", "3000", "--end", "4000", "--work", str(tmp_path)])
    default, given = seen
    assert "private" not in default and "end" not in default
    assert (given["private"], given["end"]) == (3000, 4000)
    assert standin.tag(default) != standin.tag(given)  # two folders


def test_a_stage_without_noise_exports_nothing_and_its_heads_read_its_weights(
    public_only: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """``--no-noise``: the stage at sigma ``NO_NOISE``, its weights read by the heads (not the
    prior's), no repo or ledger written; the heads charged as the job's stage."""
    recs = standin.standin_records(TINY, str(public_only), tmp_path, PRIVATE, END)
    read, kept = _weights_spied(monkeypatch)
    work = tmp_path / "work"
    t = standin.heads_trial(TINY, "vip", {"noise": "none"}, recs, work, heads=1, noise=False)
    assert not list(work.glob("**/" + LEDGER_FILE))
    sigma, q, steps = standin.encoder_stage(TINY, "vip")
    assert t.real["encoder"] == (sigma, q, steps)
    assert t.standin["encoder"] == pytest.approx((standin.NO_NOISE, 8 / PRIVATE, steps))
    noisy = standin.heads_trial(TINY, "vip", {}, recs, work, heads=1)
    assert noisy.real["head"] == t.real["head"]  # the same head noise, as if the stage cost it
    prior = load_encoder(prior_path(TINY.syn_prior)).model.state_dict()
    assert len(read) == 6 and all(a.keys() == prior.keys() for a in read)
    assert any(not torch.equal(read[0][k], prior[k]) for k in prior)
    assert all(torch.equal(read[0][k], kept[0][k]) for k in prior)  # the stage's, as released
    with pytest.raises(SystemExit):
        standin.main(["syn", "--no-noise", "--work", str(tmp_path)])
    assert "stage row" in capsys.readouterr().err
