"""The utility benchmark (``benchmarks/utility.py``) end to end on a tiny generated Fashion-MNIST:
every row trains its encoder (few steps) and its DP head, and each released classifier composes
to at most (3, 1e-5) under RDP with its encoder's stages counted."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from dp_accounting import dp_event
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
from helpers import write_idx

from training.data.labelled import FASHION_MNIST_TRAIN, fashion_mnist
from vip_hub.privacy.accounting import Accountant, calibrate, composed_epsilon
from vip_hub.privacy.ledger import Dataset, DPStage

ROOT = Path(__file__).resolve().parents[1]
SPEC = importlib.util.spec_from_file_location("utility", ROOT / "benchmarks" / "utility.py")
assert SPEC is not None and SPEC.loader is not None
utility = importlib.util.module_from_spec(SPEC)
sys.modules["utility"] = utility  # dataclasses look their module up there
SPEC.loader.exec_module(utility)

TINY = utility.Schedule(
    vip={
        "batch_size": 8,
        "steps": 2,
        "micro_batch_size": 8,
        "decoder_dim": 32,
        "decoder_depth": 1,
        "decoder_heads": 2,
    },
    dpcap={
        "batch_size": 8,
        "steps": 2,
        "micro_batch_size": 8,
        "decoder_width": 32,
        "decoder_depth": 1,
        "decoder_heads": 2,
    },
    contrastive={"batch_size": 8, "steps": 2, "trainable_blocks": 1, "projection_dim": 8},
)


def pld_epsilon(stages: list[DPStage]) -> float:
    """dp_accounting's PLD composition of every stage, computed here without our wrapper."""
    acc = PLDAccountant()
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
    return acc.get_epsilon(utility.DELTA)


TRAIN_RECORDS = 200
"""Enough that ``--tune``'s keyed 10 % validation split is never empty (0.9^200 = 7e-10; at 40
records it was empty in 1.5 % of runs)."""


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("idx")
    write_idx(folder, "train", TRAIN_RECORDS, seed=0)
    write_idx(folder, "t10k", 20, seed=1)
    return folder


def tiny_bench(data: Path, work: Path, **fields) -> utility.Bench:
    """A benchmark run on the tiny data: 2 epochs per head, the TINY schedule."""
    return utility.Bench(
        train=fashion_mnist("train", data),
        test=fashion_mnist("test", data),
        work=work,
        epochs=2,
        schedule=TINY,
        **fields,
    )


def run_rows(data: Path, work: Path, rows: list[str], tune: set[str]) -> list:
    """``rows`` through the benchmark's pipeline on the tiny data, each checked: its stages are
    on the private split only, the last is the head, and the composition is at most EPSILON under
    RDP, at least dp_accounting's PLD composition of the same stages, and within 0.01 of EPSILON
    (the head takes what the encoder left); an encoder spends at most ENCODER_EPSILON."""
    results = utility.run_benchmark(tiny_bench(data, work, tune=frozenset(tune)), rows)
    assert [r.row for r, _ in results] == [utility.ROWS[k][0] for k in rows]
    for key, (r, eps) in zip(rows, results, strict=True):
        assert {s.dataset.name for s in r.stages} == {FASHION_MNIST_TRAIN}
        assert r.stages[-1].component == "heads/utility"
        assert pld_epsilon(r.stages) <= eps[Accountant.RDP] <= utility.EPSILON, r.row
        assert eps[Accountant.RDP] > utility.EPSILON - 0.01, r.row
        assert eps[Accountant.PLD] <= eps[Accountant.RDP]
        encoder = [s.mechanism_tuple for s in r.stages[:-1]]
        assert not encoder or composed_epsilon(encoder, utility.DELTA) <= utility.ENCODER_EPSILON
        assert 0 <= r.dp <= 100 and r.ref is not None and 0 <= r.dp_rest <= 100
        learned = key not in ("pixels", "scatter")
        assert r.chosen.endswith("modes on test records 0-9") == learned, r.chosen  # 10 of 20
        assert r.tried == (len(utility.HEAD_LR_GRID) if key in tune else 0)
    lines = utility.table(results)
    assert len(lines) == 2 + len(rows) + len(utility.PAPER)
    cells = [line.split(" | ") for line in lines]
    assert all(len(c) == len(cells[0]) for c in cells)
    assert [c[0].lstrip("| ") for c in cells[-3:]] == [
        f"Tramer & Boneh: {name}" for name in utility.PAPER
    ]
    return results


def test_pixels_syn_and_vip_rows_compose_within_the_budget(data: Path, tmp_path: Path) -> None:
    results = run_rows(data, tmp_path, ["pixels", "syn", "vip"], {"pixels"})
    (_, _), (syn, _), (vip, _) = results
    assert len(syn.stages) == 1  # (Syn)-ViP saw no private data: the whole budget on its head
    assert [s.mechanism for s in vip.stages] == ["DP-AdamW", "DP-SGD"]
    bench = tiny_bench(data, tmp_path)
    again, _ = utility.run_benchmark(bench, ["vip"])[0]
    assert again.timing.cached and again.stages[0] == vip.stages[0]  # features and encoder cached
    # another split rule (--encoder-epsilon) trains its own encoder and features, at its epsilon
    wider = 2 * utility.ENCODER_EPSILON
    other, _ = utility.run_benchmark(replace(bench, encoder_epsilon=wider), ["vip"])[0]
    assert not other.timing.cached
    spent = composed_epsilon([other.stages[0].mechanism_tuple], utility.DELTA)
    assert utility.ENCODER_EPSILON < spent <= wider


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
    encoder = DPStage.from_parameters(
        name="enc",
        dataset=Dataset(name=FASHION_MNIST_TRAIN, size=60_000),
        sample_rate=0.01,
        noise_multiplier=calibrate(utility.ENCODER_EPSILON, utility.DELTA, 0.01, 500),
        steps=500,
        clipping_norm=1.0,
        noised_dimension=1_000,
        delta=utility.DELTA,
    )
    eps_alone = utility.head_epsilon([], 0.125, 80)
    eps_after = utility.head_epsilon([encoder], 0.125, 80)
    assert eps_alone == utility.EPSILON and eps_after < utility.EPSILON - 0.1
    sigma = calibrate(eps_after, utility.DELTA, 0.125, 80)
    total = composed_epsilon([encoder.mechanism_tuple, (sigma, 0.125, 80)], utility.DELTA)
    assert utility.EPSILON - 0.01 < total <= utility.EPSILON


def test_unknown_rows_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        utility.main(["--rows", "pixels,cnn", "--tune", "nope"])
    assert "unknown rows ['cnn', 'nope']" in capsys.readouterr().err


def test_the_dp_fine_tuning_row_composes_its_probe_and_its_fine_tuning_to_the_whole_budget(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The end-to-end row: a DP probe on the mode chosen on public records, then the whole encoder
    that mode reads and the head trained together by one DP stage on the private split, the two
    composed to (3, 1e-5), its top-1 on the public test split and on the records no choice saw
    (a 1-epoch probe, 2 fine-tuning steps and 64 canaries here: the row's schedule is the
    benchmark's)."""
    monkeypatch.setitem(utility.FINETUNE, "steps", 2)
    monkeypatch.setitem(utility.FINETUNE, "probe_epochs", 1)
    monkeypatch.setitem(utility.FINETUNE, "warmup_steps", 1)
    monkeypatch.setitem(utility.FINETUNE, "audit_canaries", 64)
    bench = utility.Bench(
        train=fashion_mnist("train", data),
        test=fashion_mnist("test", data),
        work=tmp_path,
        schedule=TINY,
    )
    ((r, eps),) = utility.run_benchmark(bench, ["finetune"])
    probe, stage = r.stages
    assert probe.trained_components == stage.trained_components == ("encoder", "heads/classifier")
    assert probe.epsilon == pytest.approx(utility.FINETUNE["probe_epsilon"], abs=0.01)
    assert stage.dataset.name == FASHION_MNIST_TRAIN
    assert stage.sample_rate == (TRAIN_RECORDS // 8) / TRAIN_RECORDS  # expected batch n / 8
    assert stage.hyperparameters["trainable_blocks"] == "all"
    assert stage.hyperparameters["pooling"] in r.chosen
    assert pld_epsilon(r.stages) <= eps[Accountant.RDP] <= utility.EPSILON
    assert eps[Accountant.RDP] > utility.EPSILON - 0.01
    assert 0 <= r.dp <= 100 and r.ref is not None and 0 <= r.ref <= 100 and r.tried == 0
    assert r.dp_rest is not None and 0 <= r.dp_rest <= 100
    (repo,) = (tmp_path / "finetune").glob("*/finetuned")  # the released head, read back
    assert utility.released_top1(repo, "classifier", bench.test, 0, "cpu") == pytest.approx(r.dp)
    assert len(utility.table([(r, eps)])) == 3 + len(utility.PAPER)
