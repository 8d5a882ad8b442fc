"""The prior benchmark (``benchmarks/prior.py``) on a tiny generated Fashion-MNIST test split (no
training split on disk: the private records are never read): references and a candidate in one
run, each row's head trained and its mode chosen on the first half of the test records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.helpers import load_benchmark, write_idx

from training.recipes.syn import SynConfig, train_syn

prior = load_benchmark("prior")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("fmnist")
    write_idx(folder, "t10k", 80, 1)
    return folder


def test_references_and_a_candidate_in_one_run(data: Path, tmp_path: Path) -> None:
    repo = train_syn(
        SynConfig(
            out=str(tmp_path / "cand"),
            img_size=28,
            patch_size=4,
            crop_pct=1.0,
            steps=1,
            batch_size=4,
            decoder_dim=32,
            decoder_depth=1,
            decoder_heads=2,
            workers=0,
        )
    )
    out = tmp_path / "rows.json"
    prior.main(
        [
            str(repo),
            "--data",
            str(data),
            "--fit-size",
            "50",
            "--epochs",
            "2",
            "--block-step",
            "6",
            "--json",
            str(out),
        ]
    )
    assert prior.splits(80, 50) == (slice(0, 32), slice(32, 40), slice(40, None))
    rows = json.loads(out.read_text())
    assert [r["name"] for r in rows] == [
        "raw pixels",
        "random vip-nano (12 blocks) 28 px patch 4",
        "cand",
    ]
    assert rows[0]["dims"] == 784
    # blocks 6 and 12 of 12 on every grid the 7 x 7 patch grid allows
    assert set(rows[2]["scores"]) == {f"spatial-b{b}-g{g}" for b in (6, 12) for g in (2, 4, 7)}
    for r in rows:
        assert r["mode"] in r["scores"] and r["select_top1"] == max(r["scores"].values())
        assert 0 <= r["report_top1"] <= 100
    assert rows[2]["dims"] == 192 * int(rows[2]["mode"].rsplit("g", 1)[1]) ** 2
