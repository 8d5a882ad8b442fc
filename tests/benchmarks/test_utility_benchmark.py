"""The utility benchmark (``benchmarks/utility.py``, the study of ``training/study`` at its
benchmark preset) end to end on a tiny generated Fashion-MNIST: every row trains its encoder (few
steps) and its DP head, and each released classifier composes to at most (3, 1e-5) under RDP
with its encoder's stages counted."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
from support.helpers import load_benchmark, write_idx

from training.data.labelled import FASHION_MNIST_TRAIN
from training.study import selection
from training.study.budget import head_epsilon
from training.study.config import StudyConfig
from training.study.heads import released_epsilon
from training.study.splits import study_splits
from vip_hub.errors import AuditError
from vip_hub.privacy.accounting import Accountant, calibrate, composed_epsilon
from vip_hub.privacy.ledger import (
    NOISED_CANARIES,
    NOT_RELEASED,
    Dataset,
    DPStage,
    compose_releases,
)
from vip_hub.repo.heads import load_head
from vip_hub.repo_format import ENCODER, head_component

utility = load_benchmark("utility")
step_signal = load_benchmark("step_signal")

TRAIN_RECORDS = 200
"""The tiny private split's records."""
TINY = StudyConfig(
    **{
        **utility.BENCHMARK.model_dump(),
        "train_size": TRAIN_RECORDS,
        "select_size": 10,
        "test_size": 10,
        "centre_size": 10,
        "probe_epochs": 2,
        "dp_batch_size": 8,
        "dp_steps": 2,
        "dpcap_steps": 2,
        "dp_micro_batch_size": 8,
        "decoder_dim": 32,
        "decoder_depth": 1,
        "decoder_heads": 2,
        "contrastive_batch_size": 8,
        "contrastive_steps": 2,
    }
)
"""The benchmark's study at the tiny data's sizes: 2-epoch heads, 2-step encoders."""


def pld_epsilon(stages: list[DPStage]) -> float:
    """dp_accounting's PLD composition of every stage, computed here without our wrapper, on a
    grid of 1e-3 (its pessimistic rounding keeps it an upper bound; 7x faster than 1e-4)."""
    acc = PLDAccountant(value_discretization_interval=1e-3)
    acc.compose(
        dp_event.ComposedDpEvent(
            [
                dp_event.SelfComposedDpEvent(
                    dp_event.PoissonSampledDpEvent(
                        s.sample_rate, dp_event.GaussianDpEvent(s.noise_multiplier)
                    ),
                    s.steps,
                )
                for s in stages
            ]
        )
    )
    return acc.get_epsilon(TINY.delta)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("idx")
    write_idx(folder, "train", TRAIN_RECORDS, seed=0)
    write_idx(folder, "t10k", 20, seed=1)
    return folder


def tiny_bench(data: Path, work: Path, study: StudyConfig = TINY, **fields) -> utility.Bench:
    """A benchmark run on the tiny data at ``study`` (the TINY sizes)."""
    return utility.Bench(splits=study_splits(study, data), work=work, study=study, **fields)


def run_rows(data: Path, work: Path, rows: list[str], tune: set[str], draws: int = 1) -> list:
    """``rows`` through the benchmark's pipeline on the tiny data, each checked: its stages are
    on the private split only, the last is the head, and the composition is at most the study's
    epsilon under RDP, at least dp_accounting's PLD composition of the same stages, and within 0.01
    of it (the head takes what the encoder left); an encoder spends at most its share."""
    bench = tiny_bench(data, work, tune=frozenset(tune), draws=draws)
    results = utility.run_benchmark(bench, rows)
    assert [r.row for r, _ in results] == [utility.ROWS[k][0] for k in rows]
    for key, (r, eps) in zip(rows, results, strict=True):
        assert {s.dataset.name for s in r.stages} == {FASHION_MNIST_TRAIN}
        assert r.stages[-1].component == head_component("utility")
        assert pld_epsilon(r.stages) <= eps[Accountant.RDP] <= TINY.epsilon, r.row
        assert eps[Accountant.RDP] > TINY.epsilon - 0.01, r.row
        assert eps[Accountant.PLD] <= eps[Accountant.RDP]
        encoder = [s.mechanism_tuple for s in r.stages[:-1]]
        assert not encoder or composed_epsilon(encoder, TINY.delta) <= TINY.encoder_epsilon
        assert r.correct.shape == (draws, TINY.test_size) and r.ref is not None
        assert r.dp == pytest.approx(sum(r.draws) / draws) and 0 <= r.dp <= 100
        learned = key not in ("pixels", "scatter")
        chosen = "modes on public test records 0-9, scored on "  # the first 10 of 20
        assert (chosen in r.chosen) == learned, r.chosen
        assert r.tried == (len(utility.HEAD_LR_GRID) if key in tune else 0)
    lines = utility.table(TINY, results)
    assert len(lines) == 2 + len(rows) + len(utility.PAPER)
    cells = [line.split(" | ") for line in lines]
    assert all(len(c) == len(cells[0]) for c in cells)
    for key, c in zip(rows, cells[2 : 2 + len(rows)], strict=True):
        assert ("configs on public selection records" in c[6]) == (key in tune), c[6]
    assert [c[0].lstrip("| ") for c in cells[-3:]] == [
        f"Tramer & Boneh: {name}" for name in utility.PAPER
    ]
    return results


def test_pixels_syn_and_vip_rows_compose_within_the_budget(data: Path, tmp_path: Path) -> None:
    results = run_rows(data, tmp_path, ["pixels", "syn", "vip"], {"pixels"}, draws=2)
    (_, _), (syn, _), (vip, _) = results
    ((row, other, p),) = utility.comparisons(["pixels", "syn", "vip"], [r for r, _ in results])
    assert (row, other) == (vip.row, syn.row)  # ViP against its own prior
    assert p.difference == pytest.approx((vip.dp - syn.dp) / 100)
    # the figures of 2 draws rest on both heads: more than one classifier's budget
    assert len(vip.drawn) == 3 and vip.drawn[0] == vip.stages[0]
    assert compose_releases(vip.drawn, TINY.delta)[Accountant.RDP] > TINY.epsilon + 0.5
    assert len(syn.stages) == 1  # (Syn)-ViP saw no private data: the whole budget on its head
    assert [s.mechanism for s in vip.stages] == ["DP-AdamW", "DP-SGD"]
    assert syn.chosen == vip.chosen  # one choice for the prior, read by both rows
    again, _ = utility.run_benchmark(tiny_bench(data, tmp_path), ["vip"])[0]
    assert again.timing.cached and again.stages[0] == vip.stages[0]  # features and encoder cached
    # another split rule (--encoder-epsilon) trains its own encoder and features, at its epsilon
    wider = 2 * TINY.encoder_epsilon
    study = TINY.model_copy(update={"encoder_epsilon": wider})
    other, _ = utility.run_benchmark(tiny_bench(data, tmp_path, study), ["vip"])[0]
    assert not other.timing.cached
    spent = composed_epsilon([other.stages[0].mechanism_tuple], TINY.delta)
    assert TINY.encoder_epsilon < spent <= wider


def test_encoder_draws_train_an_encoder_each_and_the_comparison_counts_encoders(
    data: Path, tmp_path: Path
) -> None:
    """``--encoder-draws 2``: the ViP row trains two encoders (fresh secrets), each read by its
    own heads; its figures rest on both; the paired draw term is over the encoders' means."""
    bench = tiny_bench(data, tmp_path, draws=2, encoder_draws=2)
    (syn, _), (vip, _) = utility.run_benchmark(bench, ["syn", "vip"])
    assert syn.encoders == 1 and syn.correct.shape == (2, TINY.test_size)  # the prior: one
    assert vip.encoders == 2 and vip.correct.shape == (4, TINY.test_size)
    assert "2 encoders x 2 heads" in vip.spread()
    encoders = [s for s in vip.drawn if s.mechanism == "DP-AdamW"]
    assert len(encoders) == 2 and encoders[0].run_id != encoders[1].run_id
    repos = sorted(p for p in (tmp_path / "encoders").iterdir() if p.suffix != ".run")
    assert len(vip.drawn) == 6 and repos == [utility.vip_repo(bench, d) for d in (0, 1)]
    means = vip.encoder_means()
    assert means.shape == (2, TINY.test_size)
    np.testing.assert_allclose(means[1], vip.correct[2:].mean(0))
    assert syn.encoder_means() is syn.correct  # one encoder: its head draws are the units
    ((_, _, p),) = utility.comparisons(["syn", "vip"], [syn, vip])
    by_encoder = means.mean(1)
    expected = np.sqrt(by_encoder.var(ddof=1) / 2 + np.var(syn.correct.mean(1), ddof=1) / 2)
    assert p.se_draws == pytest.approx(expected)
    assert p.difference == pytest.approx((vip.dp - syn.dp) / 100)


def test_heads_read_k_public_components_and_release_the_head_on_the_features(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row's head reads the top k components of its centring records' features (the first
    public selection records', never the private records'), and releases the head on the
    features."""
    study = TINY.model_copy(update={"head_components": 4})
    bench = tiny_bench(data, tmp_path, study)
    centred: list[tuple[int, torch.Tensor]] = []
    fit = utility.dp_head
    monkeypatch.setattr(
        utility,
        "dp_head",
        lambda cfg, x, y, centre, *rest, **named: (
            centred.append((len(x), centre)) or fit(cfg, x, y, centre, *rest, **named)
        ),
    )
    ((r, eps),) = utility.run_benchmark(bench, ["pixels"])
    public = utility.pixels(bench.splits.centre)
    assert len(centred) == bench.draws
    assert all(n == len(bench.private) and torch.equal(c, public) for n, c in centred)
    head = r.stages[-1]
    # the noise went to 4 coordinates (and the bias) of a head no file holds
    assert sum(head.noised_tensors.values()) == (4 + 1) * len(bench.private.classes)
    assert all(key.startswith(f"{NOT_RELEASED}:") for key in head.noised_tensors)
    assert "top 4 principal components" in head.description
    assert study.epsilon - 0.01 < eps[Accountant.RDP] <= study.epsilon


@pytest.mark.slow
def test_scatter_dpcap_and_contrastive_rows_compose_within_the_budget(
    data: Path, tmp_path: Path
) -> None:
    results = run_rows(data, tmp_path, ["scatter", "dpcap", "logit-dp", "naive-dp"], set())
    assert [[s.mechanism for s in r.stages] for r, _ in results] == [
        ["DP-SGD"],
        ["DP-AdamW", "DP-SGD"],
        ["Logit-DP", "DP-SGD"],
        ["Naive-DP", "DP-SGD"],
    ]


def test_a_head_after_an_encoder_gets_only_the_rest_of_the_budget() -> None:
    study = utility.BENCHMARK
    encoder = DPStage.from_parameters(
        name="enc",
        dataset=Dataset(name=FASHION_MNIST_TRAIN, size=60_000),
        sample_rate=0.01,
        noise_multiplier=calibrate(study.encoder_epsilon, study.delta, 0.01, 500),
        steps=500,
        clipping_norm=1.0,
        noised_tensors={"unreleased:test": 1_000},
        delta=study.delta,
    )
    eps_alone = head_epsilon(study, [], 0.125, 80)
    eps_after = head_epsilon(study, [encoder], 0.125, 80)
    assert eps_alone == study.epsilon and eps_after < study.epsilon - 0.01
    sigma = calibrate(eps_after, study.delta, 0.125, 80)
    total = composed_epsilon([encoder.mechanism_tuple, (sigma, 0.125, 80)], study.delta)
    assert study.epsilon - 0.01 < total <= study.epsilon


class Declared:
    """Private records of which only what is declared public can be read: n, the dataset's
    identity and the class names (a record or a label is an AttributeError)."""

    def __init__(self, records: Any) -> None:
        self.n, self.dataset, self.classes = len(records), records.dataset, records.classes

    def __len__(self) -> int:
        return self.n


def test_tuning_reads_public_selection_records_at_the_real_heads_noise(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--tune``: every candidate learning rate is scored by DP heads at the real row's noise
    on the public selection records (``selection_scores``), and no private record, label or
    feature is read."""
    bench = tiny_bench(data, tmp_path, tune=frozenset({"pixels"}))
    f = utility.pixel_features(bench)
    calls, scores = [], selection.selection_scores

    def spy(feats: Any, labels: np.ndarray, classes: int, cfg: Any, n: int, *a: Any) -> Any:
        calls.append((labels, cfg, n))
        return scores(feats, labels, classes, cfg, n, *a)

    monkeypatch.setattr(selection, "selection_scores", spy)
    blind = replace(bench, splits=replace(bench.splits, private=Declared(bench.private)))
    lr, tried = utility.tune_lr(blind, replace(f, train=object()))  # no private feature either
    assert list(tried) == list(utility.HEAD_LR_GRID) and tried[lr] == max(tried.values())
    real = released_epsilon(TINY, "sgd", TRAIN_RECORDS, FASHION_MNIST_TRAIN, f.stages)
    assert [c.lr for _, c, _ in calls] == list(utility.HEAD_LR_GRID)
    for labels, cfg, n in calls:
        np.testing.assert_array_equal(labels, bench.splits.selection.labels)
        assert n == TRAIN_RECORDS and cfg.epsilon == pytest.approx(real)


def test_unknown_rows_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        utility.main(["--rows", "pixels,cnn", "--tune", "nope"])
    assert "unknown rows ['cnn', 'nope']" in capsys.readouterr().err


def test_a_schedule_without_steps_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        utility.main(["--rows", "finetune", "--finetune-steps", "0"])
    assert "--finetune-steps are at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("fixed_head", [False, True])
def test_the_dp_fine_tuning_row_composes_its_probe_and_its_fine_tuning_to_the_whole_budget(
    data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    fixed_head: bool,
) -> None:
    """The end-to-end row: a DP probe on the mode chosen on public records, then the whole encoder
    that mode reads and the head trained together by one DP stage on the private split (or, with
    ``--finetune-fixed-head``, under the probe's head), the two composed to (3, 1e-5), the
    released classifier's top-1 on the scoring records (a 2-epoch probe, 2 fine-tuning steps
    (``--finetune-steps``) and 64 canaries here: the row's schedule is the benchmark's); then
    benchmarks/step_signal.py on the released repo, its noise from the ledger. A run its audit
    flags is trained again from a fresh secret."""
    monkeypatch.setitem(utility.FINETUNE, "warmup_steps", 1)
    monkeypatch.setitem(utility.FINETUNE, "audit_canaries", 64)
    bench = tiny_bench(data, tmp_path, finetune_steps=2, finetune_fixed_head=fixed_head)
    import training.recipes.finetune

    publics: list[Any] = []
    finetune = training.recipes.finetune.finetune_arrays
    monkeypatch.setattr(
        training.recipes.finetune,
        "finetune_arrays",
        lambda *args, **named: publics.append(named["public"]) or finetune(*args, **named),
    )
    runs: list[str] = []  # the first run's audit flags it: the row trains it again, not stop
    real = training.recipes.finetune.train_finetune

    def flagged_first(cfg: Any) -> Path:
        runs.append(cfg.out)
        if len(runs) == 1:
            raise AuditError(["test: the first run's audit flagged it"])
        return real(cfg)

    monkeypatch.setattr(training.recipes.finetune, "train_finetune", flagged_first)
    ((r, eps),) = utility.run_benchmark(bench, ["finetune"])
    assert len(runs) == 2 and runs[0] == runs[1] and "flagged the run" in capsys.readouterr().err
    assert publics == [bench.splits.centre]  # its heads centred on public records, not private
    probe, stage = r.stages
    assert stage.steps == 2 and stage.hyperparameters["fixed_head"] is fixed_head
    assert probe.trained_components == (ENCODER, head_component("classifier"))
    assert stage.trained_components == probe.trained_components[: 1 if fixed_head else 2]
    assert ("under the probe's head, fixed" in r.what) is fixed_head
    assert probe.epsilon == pytest.approx(utility.FINETUNE["probe_epsilon"], abs=0.01)
    assert stage.dataset.name == FASHION_MNIST_TRAIN
    assert stage.sample_rate == (TRAIN_RECORDS // 8) / TRAIN_RECORDS  # expected batch n / 8
    assert stage.hyperparameters["trainable_blocks"] == "all"
    trains = utility.FINETUNE["encoder_parameters"]
    assert stage.hyperparameters["encoder_parameters"] == trains
    assert stage.hyperparameters["lr"] == utility.FINETUNE_LR[trains]
    assert stage.hyperparameters["pooling"] in r.chosen
    assert pld_epsilon(r.stages) <= eps[Accountant.RDP] <= TINY.epsilon
    assert eps[Accountant.RDP] > TINY.epsilon - 0.01
    assert 0 <= r.dp <= 100 and r.ref is not None and 0 <= r.ref <= 100 and r.tried == 0
    (repo,) = (tmp_path / "finetune").glob("*/finetuned")  # the released head, read back
    head, info = load_head(repo, "classifier")
    assert r.dp == pytest.approx(100 * info.metrics["top1"])
    # the stage's own rule: its noised coordinates (canaries aside) and its noise on the mean
    noised = sum(v for k, v in (stage.noised_tensors or {}).items() if k != NOISED_CANARIES)
    on_mean = stage.noise_multiplier * stage.sensitivity * noised**0.5 / stage.expected_batch_size
    out = step_signal.step_signal(repo, bench.splits.test)
    assert sum(out["coordinates"].values()) == noised
    assert out["noise_norm"] == pytest.approx(on_mean)
    # the other rule: the head's linear layer in or out
    other = step_signal.step_signal(repo, bench.splits.test, fixed_head=not fixed_head)
    linear = head.linear.weight.numel() + head.linear.bias.numel()
    heads = {True: 0, False: linear}
    for o, fixed in ((out, fixed_head), (other, not fixed_head)):
        parts, mean = o["coordinates"], o["mean_norm"]
        assert parts == {
            "encoder": stage.hyperparameters["encoder_trainable_parameters"],
            "head": heads[fixed],
        }
        assert mean["all"] ** 2 == pytest.approx(mean["encoder"] ** 2 + mean["head"] ** 2)
        assert 0 < mean["all"] <= stage.clipping_norm and 0 <= o["clipped"] <= 1
    assert len(utility.table(TINY, [(r, eps)])) == 3 + len(utility.PAPER)
