"""What a released guarantee must survive (issue 22, ``../shared/DESIGN.md``): a DP head's noise and
sampling come from a secret, subsets of private data are stable when another record comes or goes,
nothing released carries a plain hash of the private data or a figure without a guarantee, and
``verify`` refuses structural gaps."""

from __future__ import annotations

import secrets
from pathlib import Path

import numpy as np
import pytest
import torch
from support.helpers import published_hashes_of, staged_reports, write_digits

from training.data.labelled import keyed_uniforms
from training.recipes.probe import ProbeConfig, fit_probe, run_probe
from vip_hub.errors import VipHubError
from vip_hub.repo.verify import verify_repo
from vip_hub.repo_format import CARD_FILE, HEAD_LABELS, HEAD_WEIGHTS, head_component, head_file

N, DIM = 64, 6


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, DIM, generator=g)
    y = (x[:, 0] > 0).long()
    return (
        x,
        y,
        torch.randn(128, DIM, generator=g),
    )  # the last: "public" features for the normalisation


def _dp_head(batch: int, **kw) -> torch.Tensor:
    x, y, public = _data()
    cfg = ProbeConfig(
        encoder="",
        data="",
        dataset_name="test/points",
        epsilon=4.0,
        epochs=3,
        warmup_epochs=0,
        optimizer="sgd",
        lr=0.5,
        batch_size=batch,
        seed=0,
        **kw,
    )
    head, _ = fit_probe(x, y, 2, cfg, public_x=public)
    return torch.cat([p.detach().flatten() for p in head.linear.parameters()])


def test_a_dp_head_takes_its_noisy_steps_on_empty_poisson_samples() -> None:
    """q = 1/N: about a third of the steps sample nobody; each still takes a noisy step (the DP
    engine's step on an empty sample) instead of crashing."""
    params = _dp_head(batch=1)
    assert torch.isfinite(params).all()


def test_two_dp_heads_with_the_same_seed_get_different_noise() -> None:
    """batch = n: Poisson sampling at q = 1 takes every record, so only the noise can differ
    (today's code seeded it with --seed: both heads were bit-identical)."""
    a, b = _dp_head(batch=N), _dp_head(batch=N)
    assert not torch.equal(a, b)


@pytest.mark.parametrize("mechanism", ["sampling", "noise"])
def test_a_dp_heads_sampling_and_noise_are_keyed_by_its_whole_secret(
    monkeypatch: pytest.MonkeyPatch, mechanism: str
) -> None:
    """The same 128-bit secret gives the same head; secrets differing only in bit 100 (out of
    reach of the 63-bit torch seed of before, and of a 32-bit search) give different heads. For
    the sampling the noise is off (batch 8 of 64: only the Poisson sample can differ); for the
    noise q = 1 (every record sampled at every step: only the noise can differ)."""
    import training.dp.engine

    if mechanism == "sampling":  # the heads' noise is the DP engine's
        monkeypatch.setattr(training.dp.engine, "add_gaussian_noise", lambda *args: None)
    key = 0x0123_4567_89AB_CDEF_FEDC_BA98_7654_3210
    heads = []
    for secret in (key, key, key ^ (1 << 100)):
        monkeypatch.setattr(secrets, "token_bytes", lambda n, s=secret: s.to_bytes(n, "little"))
        heads.append(_dp_head(batch=8 if mechanism == "sampling" else N))
    assert torch.equal(heads[0], heads[1])
    assert not torch.equal(heads[0], heads[2])


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_digits(tmp_path_factory.mktemp("digits"), test_fraction=0.2, seed=0)


def test_no_exported_file_holds_the_heads_secrets_or_a_hash_of_the_data(
    tiny_repo: Path, digits: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    drawn: list[bytes] = []
    bits, token = secrets.randbits, secrets.token_bytes

    def randbits(k: int) -> int:
        v = bits(k)
        drawn.append(v.to_bytes(8, "little"))
        drawn.extend([v.to_bytes(8, "big"), str(v).encode(), f"{v:x}".encode()])
        return v

    def token_bytes(n: int) -> bytes:
        v = token(n)
        drawn.extend([v, v.hex().encode()])
        return v

    monkeypatch.setattr(secrets, "randbits", randbits)
    monkeypatch.setattr(secrets, "token_bytes", token_bytes)
    train, _ = digits
    out = tmp_path / "repo"
    run_probe(
        ProbeConfig(
            encoder=str(tiny_repo),
            data=str(train),
            head="d",
            epochs=2,
            warmup_epochs=0,
            epsilon=2.0,
            optimizer="sgd",
            lr=1.0,
            out=str(out),
            dataset_name="test/digits",
            classes=[str(d) for d in range(10)],  # public labels (no --test-data)
        )
    )
    assert len(drawn) >= 4  # the head's secret (noise, sampling) and the subset key were drawn
    released = b"".join(p.read_bytes() for p in out.rglob("*") if p.is_file())
    assert not [d for d in drawn if d in released]
    assert not published_hashes_of(train, out)
    assert verify_repo(out).ok


def test_a_records_membership_does_not_depend_on_other_records(
    tiny_repo: Path, digits: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The held-out split and the few-shot choice of D and of D without one record agree on every
    other record (today's seeded permutation reshuffled all of them)."""
    train, _ = digits
    smaller = tmp_path / "smaller"
    for f in train.rglob("*.png"):
        (smaller / f.parent.name).mkdir(parents=True, exist_ok=True)
        (smaller / f.parent.name / f.name).write_bytes(f.read_bytes())
    removed = sorted((train / "4").glob("*.png"))[0]
    (smaller / "4" / removed.name).unlink()
    key = b"k" * 32
    monkeypatch.setattr(secrets, "token_bytes", lambda n: key)  # the same secret in both worlds
    kept = []
    for data in (train, smaller):
        r = run_probe(
            ProbeConfig(
                encoder=str(tiny_repo),
                data=str(data),
                few_shot_rate=0.2,
                epochs=1,
                warmup_epochs=0,
                export=False,
                dataset_name="test/digits",
            )
        )
        kept.append((r.features["train_x"], r.features["test_x"]))
    gone = torch.from_numpy(_features_of(tiny_repo, removed))
    for full, small in zip(*kept, strict=True):
        assert _same_records(full[_distances(full, gone).min(1).values > 1e-3], small)
    files = sorted(train.rglob("*.png"))
    labels = np.array([int(f.parent.name) for f in files])
    u = keyed_uniforms(key, "held-out", files, labels)
    assert np.array_equal(u[1:], keyed_uniforms(key, "held-out", files[1:], labels[1:]))
    assert not np.array_equal(u, keyed_uniforms(b"other" * 8, "held-out", files, labels))


def _same_records(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two feature matrices hold the same records in any order: as many rows, each of
    ``a`` within 1e-3 of a row of ``b`` (batched inference changes the last digits, so rounded
    features are no identity)."""
    return len(a) == len(b) and bool((_distances(a, b).min(1).values < 1e-3).all())


def _distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Euclidean distances row by row, computed directly (cdist's matrix-product shortcut is off
    by about 0.03 at these norms in float32)."""
    return torch.cdist(a.double(), b.double(), compute_mode="donot_use_mm_for_euclid_dist")


def _features_of(repo: Path, image: Path) -> np.ndarray:
    """The removed record's features, copied from a probe on the full folder (same encoder, same
    pooling)."""
    from PIL import Image

    from vip_hub.loading import load_encoder

    return load_encoder(str(repo)).embed([Image.open(image).convert("RGB")], "vip").numpy()


def test_verify_refuses_a_head_folder_without_a_stage_of_its_own(
    tiny_repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Such a head once verified and inherited the encoder's summary; an update adding one is
    refused, and a repo holding one (written past that check) fails verify."""
    from safetensors.torch import save

    from vip_hub.repo.files import update_repo

    evil = {
        head_file("evil", HEAD_WEIGHTS): save({"w": torch.zeros(2)}),
        head_file("evil", HEAD_LABELS): b"[]",
    }
    folder = f"{head_component('evil')}/"
    with pytest.raises(VipHubError, match=folder):
        update_repo(tiny_repo, add_files=evil)
    assert verify_repo(tiny_repo).ok  # left as it was
    staged_reports(monkeypatch)
    update_repo(tiny_repo, add_files=evil)
    report = verify_repo(tiny_repo)
    where = [p.where for p in report.problems]  # no stage; and no head a loader could read
    assert not report.ok and where == [folder, head_file("evil", HEAD_WEIGHTS)]


def test_verify_warns_that_a_shuffled_stage_assumes_poisson_sampling(tmp_path: Path) -> None:
    from support.helpers import TINY, synthetic_stage, tiny_encoder

    from vip_hub import Dataset, DPStage, export_encoder

    shuffled = DPStage.from_parameters(
        name="dp-pretraining",
        dataset=Dataset(name="org/pairs", size=1000),
        sample_rate=0.1,
        noise_multiplier=1.0,
        steps=40,
        clipping_norm=1.0,
        noised_tensors={"unreleased:test": 1_000},
        sampling="shuffle",
    )
    repo = export_encoder(
        tmp_path / "r", tiny_encoder(), TINY, [synthetic_stage(), shuffled], model_name="r"
    )
    report = verify_repo(repo)
    assert report.ok and any("assuming Poisson sampling" in w for w in report.warnings)
    card = (repo / CARD_FILE).read_text()
    assert "as reported, assuming Poisson sampling" in card.split("| Privacy |")[1].split("\n")[0]


def test_the_dataset_page_composes_every_public_release_on_it(hub, tmp_path: Path) -> None:
    """Releases on one dataset across repos (encoders and heads) are composed on its page, linked
    from each model page; the composition is recomputed here with dp_accounting from the raw (q,
    sigma, T)."""
    import httpx
    from dp_accounting import dp_event
    from dp_accounting.rdp import RdpAccountant
    from support.helpers import TINY, synthetic_stage, tiny_encoder
    from support.live import WRITE_TOKEN

    from vip_hub import Dataset, DPStage, export_encoder
    from vip_hub.repo.push import push_repo

    data = Dataset(name="writer/shared-faces", size=2000)
    stages = [
        DPStage.from_parameters(
            name="dp-pretraining",
            dataset=data,
            sample_rate=0.05,
            noise_multiplier=s,
            steps=t,
            clipping_norm=1.0,
            noised_tensors={"unreleased:test": 1_000},
        )
        for s, t in ((1.0, 200), (1.5, 300))
    ]
    for i, stage in enumerate(stages):
        repo = export_encoder(
            tmp_path / f"r{i}",
            tiny_encoder(i),
            TINY,
            [synthetic_stage(), stage],
            model_name=f"r{i}",
        )
        push_repo(repo, f"writer/shared-{i}", token=WRITE_TOKEN)
    page = httpx.get(f"{hub.url}/datasets/writer/shared-faces", timeout=30)
    assert page.status_code == 200, page.text
    acc = RdpAccountant()
    for s in stages:
        acc.compose(
            dp_event.PoissonSampledDpEvent(
                s.sample_rate, dp_event.GaussianDpEvent(s.noise_multiplier)
            ),
            s.steps,
        )
    composed = acc.get_epsilon(1e-5)
    assert composed > max(s.epsilon for s in stages)
    shown = float(page.text.split("ε = ")[1].split(" (RDP)")[0])
    assert shown >= composed and shown == pytest.approx(composed, abs=0.02)  # rounded up
    assert "/writer/shared-0" in page.text and "/writer/shared-1" in page.text
    model = httpx.get(f"{hub.url}/writer/shared-0", timeout=30)
    assert 'href="/datasets/writer/shared-faces"' in model.text
    assert httpx.get(f"{hub.url}/datasets/test/nobody", timeout=30).status_code == 404


def test_a_shuffled_release_is_qualified_in_responses_pages_and_the_index(
    hub, tmp_path: Path
) -> None:
    import base64
    import io

    import httpx
    from PIL import Image
    from support.helpers import TINY, synthetic_stage, tiny_encoder
    from support.live import WRITE_TOKEN

    from vip_hub import Dataset, DPStage, export_encoder
    from vip_hub.repo.push import push_repo

    shuffled = DPStage.from_parameters(
        name="dp-pretraining",
        dataset=Dataset(name="org/pairs", size=1000),
        sample_rate=0.1,
        noise_multiplier=1.0,
        steps=40,
        clipping_norm=1.0,
        noised_tensors={"unreleased:test": 1_000},
        sampling="shuffle",
    )
    repo = export_encoder(
        tmp_path / "r", tiny_encoder(), TINY, [synthetic_stage(), shuffled], model_name="r"
    )
    push_repo(repo, "writer/shuffled", token=WRITE_TOKEN)
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (10, 200, 30)).save(buf, format="PNG")
    r = httpx.post(
        f"{hub.url}/v1/embeddings",
        timeout=60,
        json={"model": "writer/shuffled", "input": [base64.b64encode(buf.getvalue()).decode()]},
    )
    assert r.status_code == 200, r.text
    privacy = r.json()["privacy"]
    assert (
        "assuming Poisson sampling" in privacy["caveat"]
        and "assuming Poisson sampling" in privacy["headline"]
    )
    assert privacy["epsilon_without_amplification"] > privacy["epsilon"]
    assert (
        "assuming Poisson sampling"
        in httpx.get(f"{hub.url}/api/models/writer/shuffled").json()["vip_hub"]["caveat"]
    )
    assert "as reported*" in httpx.get(f"{hub.url}/?q=shuffled").text
    assert "assuming Poisson sampling" in httpx.get(f"{hub.url}/writer/shuffled").text


def test_pages_and_cards_say_which_epsilon_is_the_encoders_and_which_a_heads(
    hub, tmp_path: Path
) -> None:
    import httpx
    from support.helpers import tiny_repo_with_head
    from support.live import WRITE_TOKEN

    from vip_hub.repo.push import push_repo

    repo = tiny_repo_with_head(tmp_path / "labelled")
    push_repo(repo, "writer/labelled", token=WRITE_TOKEN)
    html = httpx.get(f"{hub.url}/writer/labelled", timeout=30).text
    assert "The encoder: <strong>(ε = " in html and "The encoder with head toy: <strong>" in html
    card = (repo / CARD_FILE).read_text()
    assert "(the encoder) |" in card and "| Privacy with head `toy` | " in card
