"""Linear probes (non-DP, DP, few-shot), head export and classification through the service
(on scikit-learn's tiny digits), the main job at its smallest sizes (on generated Fashion-MNIST
IDX files), and the shipping files."""

from __future__ import annotations

import base64
import json
import shutil
import signal
import subprocess
import sys
import threading
from functools import cache, partial
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from support.helpers import ROOT, write_digits, write_fashion
from support.live import WRITE_TOKEN
from support.ports import free_port

from training.data.labelled import FASHION_MNIST_TRAIN, fashion_mnist
from training.main_job import (
    HEAD,
    PIXELS_HEAD,
    PUBLISHED,
    MainJobConfig,
    _duration,
    _Steps,
    run_main_job,
)
from training.recipes.probe import ProbeConfig, run_probe
from vip_hub.errors import AuditError, ConfigError, DataError, StepFailed
from vip_hub.loading import load_encoder
from vip_hub.privacy.ledger import DPStage, PrivacyLedger, shown_epsilon
from vip_hub.repo.card import card_info
from vip_hub.repo.heads import list_heads, load_head
from vip_hub.repo.push import push_repo
from vip_hub.repo.signing import load_keys, verify_signature
from vip_hub.repo.verify import verify_repo
from vip_hub.repo_format import (
    CARD_FILE,
    ENCODER,
    HEADS_DIR,
    VOCAB_FILE,
    WEIGHTS_FILE,
    head_component,
)


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_digits(tmp_path_factory.mktemp("digits"), test_fraction=0.2, seed=0)


def test_probe_beats_chance_and_says_its_labels_have_no_guarantee(tiny_repo: Path, digits) -> None:
    train, test = digits
    r = run_probe(
        ProbeConfig(
            encoder=str(tiny_repo),
            data=str(train),
            test_data=str(test),
            head="digits",
            epochs=15,
            warmup_epochs=2,
            dataset_name="test/digits-train",
        )
    )
    assert r.top1 > 0.3, r.top1  # chance is 0.1
    assert r.repo == tiny_repo and list_heads(tiny_repo) == ["digits"]
    assert verify_repo(tiny_repo).ok
    stage = PrivacyLedger.read(tiny_repo).stage("linear-probe:digits")
    assert (
        stage.type == "non-private"
        and stage.private_data
        and stage.component == head_component("digits")
    )
    assert stage.dataset.name == "test/digits-train" and stage.dataset.size == 1437
    card = (tiny_repo / CARD_FILE).read_text()
    assert "No guarantee covers" in card and "linear-probe:digits" in card
    assert "top-1, linear probe 'digits' (vip features, no DP)" in card  # model-index entry
    _head, info = load_head(tiny_repo, "digits")
    assert info.labels == [str(d) for d in range(10)] and info.metrics["top1"] == pytest.approx(
        r.top1
    )


def test_a_feature_mode_is_scored_by_a_head_fit_on_each_half_and_scored_on_the_other(
    tiny_repo: Path, digits, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``choose_pooling`` is two-fold: per mode, a head fit on the first half of the public images
    scored on the second, one fit on the second scored on the first, and the mode's score the
    mean of the two (an odd last image is in neither half)."""

    import training.recipes.probe as probe

    data = probe.load_labelled(digits[0], "test/digits-train")
    images = data.images[:41]
    fits, scored = [], []
    fit_probe, accuracy = probe.fit_probe, probe.accuracy

    def recording_fit(x, y, *args, **kwargs):
        fits.append(x.clone())
        return fit_probe(x, y, *args, **kwargs)

    def recording_accuracy(head, x, y):
        top1 = accuracy(head, x, y)
        scored.append((x.clone(), top1))
        return top1

    monkeypatch.setattr(probe, "fit_probe", recording_fit)
    monkeypatch.setattr(probe, "accuracy", recording_accuracy)
    encoder = load_encoder(tiny_repo)
    cfg = ProbeConfig(encoder="", data="", dataset_name="test/digits-train", epochs=2)
    mode, scores = probe.choose_pooling(encoder, images, data.labels[:41], 10, cfg, 1000)
    feats = encoder.embed(images, encoder.encoder_poolings)
    assert len(fits) == len(scored) == 2 * len(feats) and set(scores) == set(feats)
    assert "pixels" in encoder.poolings and "pixels" not in scores  # reads no encoder weight
    for i, (m, x) in enumerate(feats.items()):
        (first, second), (on_second, on_first) = fits[2 * i : 2 * i + 2], scored[2 * i : 2 * i + 2]
        assert torch.allclose(first, x[:20]) and torch.allclose(second, x[20:40])
        assert torch.allclose(on_second[0], x[20:40]) and torch.allclose(on_first[0], x[:20])
        assert scores[m] == pytest.approx(100 * (on_second[1] + on_first[1]) / 2)
    assert scores[mode] == max(scores.values())

    # on public components: every mode's heads read 3 of them, fit on its own images' map
    fits.clear()
    probe.choose_pooling(encoder, images, data.labels[:41], 10, cfg, 1000, components=3)
    assert [f.shape[1] for f in fits] == [3] * 2 * len(feats)
    # their directions from the first 12 records alone, as the study's from its centring ones
    fits.clear()
    probe.selection_scores(feats, data.labels[:41], 10, cfg, 1000, components=3, basis=12)
    for i, x in enumerate(feats.values()):
        assert torch.allclose(fits[2 * i], probe.public_components(x[:12], 3)(x)[:20])


def test_a_dp_head_without_public_data_says_its_normalisation_is_procedural(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`vip-hub probe` and `train-finetune` say on stderr when a DP head has no --public-data
    to centre it (and say nothing when it has, or when the head is not DP)."""
    from training.commands import note_head_statistics
    from training.recipes.finetune import FinetuneConfig

    dp = {"encoder": "", "data": "", "epsilon": 3.0, "delta": 1e-5, "dataset_name": "org/labels"}
    tune = {"out": "o", "data": "d", "dataset_name": "org/labels", "init": "i"}
    for cfg in (ProbeConfig(**dp), FinetuneConfig(**tune)):
        note_head_statistics(cfg)
        assert "no --public-data" in capsys.readouterr().err
    for cfg in (
        ProbeConfig(**dp, public_data=str(tmp_path)),
        FinetuneConfig(**tune, public_data=str(tmp_path)),
        ProbeConfig(encoder="", data="", dataset_name="org/labels"),
    ):
        note_head_statistics(cfg)
    assert capsys.readouterr().err == ""


def test_dp_heads_are_centred_on_public_images_of_the_domain(
    tiny_repo: Path, digits, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--public-data``: a DP head's BatchNorm is fixed to the mean of the encoder's features of
    those public images with variance 1 (features shifted by the shared component, scale kept);
    mode selection centres its DP heads on its public images the same way; without public images
    the head keeps the procedural images' statistics."""

    import training.recipes.probe as probe

    x = torch.randn(50, 6) * 3 + torch.arange(6.0) * 10  # a large component every example shares
    head = probe.LinearProbe(6, 2)
    probe.fix_normalisation(head, probe.centred_statistics(x))
    assert torch.allclose(head.norm(x), x - x.mean(0), atol=1e-3)
    with pytest.raises(DataError, match="at least one public image"):
        probe.centred_statistics(x[:0])

    train, test = digits
    encoder = load_encoder(tiny_repo)
    public = probe.load_public_images(test)
    cfg = ProbeConfig(
        encoder=str(tiny_repo),
        data=str(train),
        head="centred",
        epochs=2,
        epsilon=2.0,
        optimizer="sgd",
        dataset_name="test/digits-train",
        classes=[str(d) for d in range(10)],  # public labels (no --test-data)
    )
    for public_data, mean, var in (
        (str(test), encoder.embed(public, "vip").mean(0), torch.ones(encoder.feature_dim("vip"))),
        (None, *(f(probe.public_features(encoder, "vip"), 0) for f in (torch.mean, torch.var))),
    ):
        out = tmp_path / ("centred" if public_data else "procedural")
        r = run_probe(cfg.model_copy(update={"public_data": public_data, "out": str(out)}))
        norm = load_head(r.repo, "centred")[0].norm
        assert torch.allclose(norm.running_mean, mean, atol=1e-5)
        assert torch.allclose(norm.running_var, var, rtol=1e-2)
        described = PrivacyLedger.read(r.repo).stage("linear-probe-dp:centred").description
        assert ("centred on public images" in described) == (public_data is not None)

    with pytest.raises(ValueError, match="must not score it"):
        ProbeConfig(**{**cfg.model_dump(), "test_data": str(test), "public_data": f"{test}/."})

    seen = []
    fit_probe = probe.fit_probe

    def recording_fit(x, y, classes, cfg, public_x=None, **kwargs):
        seen.append((x, public_x))
        return fit_probe(x, y, classes, cfg, public_x, **kwargs)

    monkeypatch.setattr(probe, "fit_probe", recording_fit)
    labels = probe.load_labelled(test, "public/test").labels
    probe.choose_pooling(encoder, public[:20], labels[:20], 10, cfg, 1000)
    feats = encoder.embed(public[:20], encoder.encoder_poolings)
    assert len(seen) == 2 * len(feats)
    for i, x in enumerate(feats.values()):
        for _, public_x in seen[2 * i : 2 * i + 2]:
            assert torch.equal(public_x, probe.centred_statistics(x))


def test_dp_probe_has_a_dp_stage_within_its_budget(tiny_repo: Path, digits, tmp_path: Path) -> None:
    from vip_hub.privacy.sensitivity import (
        FP64_CAPPED,
        ROUNDING_SUM,
        ROUNDING_TERMS,
        rounding_allowance,
        sample_bound,
    )

    train, test = digits
    out = tmp_path / "with-dp-head"
    r = run_probe(
        ProbeConfig(
            encoder=str(tiny_repo),
            data=str(train),
            test_data=str(test),
            head="digits-dp",
            epochs=10,
            warmup_epochs=1,
            epsilon=2.0,
            optimizer="sgd",
            lr=1.0,
            out=str(out),
            dataset_name="test/digits-train",
        )
    )
    assert r.top1 > 0.2, r.top1
    assert verify_repo(out).ok and not (tiny_repo / HEADS_DIR).exists()  # written to --out only
    ledger = PrivacyLedger.read(out)
    stage = ledger.stage("linear-probe-dp:digits-dp")
    assert (
        stage.type == "dp"
        and stage.mechanism == "DP-SGD"
        and stage.component == head_component("digits-dp")
    )
    assert (
        stage.epsilon <= 2.0 and stage.dataset.size == 1437 and stage.delta == pytest.approx(1e-5)
    )
    assert stage.steps == 10 * 6 and stage.sample_rate == pytest.approx(1 / 6)
    terms = sample_bound(1437, stage.sample_rate)  # the proved allowance, recorded and applied
    assert stage.mechanism_params == {ROUNDING_TERMS: terms, ROUNDING_SUM: FP64_CAPPED}
    assert stage.sensitivity == stage.clipping_norm * rounding_allowance(terms, FP64_CAPPED) > 1.0
    guarantee = next(g for g in ledger.guarantees if g.dataset == stage.dataset.name)
    assert guarantee.epsilon == pytest.approx(
        stage.epsilon
    )  # the labelled data is covered by the head's DP


def test_dp_head_clips_each_examples_own_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-example norms the head's clipper computes are each example's own, as a lone
    example's backward gives them, and with the noise zeroed the step is SGD on the sum of those
    gradients, each clipped to the head's norm, over the expected batch; the noise asked for is
    sigma times the recorded sensitivity, C times the proved rounding allowance of b terms."""

    import training.dp.engine
    from training.dp.clipping import PerExampleClipper
    from training.recipes.probe import fit_probe
    from vip_hub.privacy.sensitivity import (
        FP64_CAPPED,
        ROUNDING_SUM,
        ROUNDING_TERMS,
        rounding_allowance,
        sample_bound,
    )
    from vip_hub.repo.heads import LinearProbe

    g = torch.Generator().manual_seed(0)
    x, public = torch.randn(12, 5, generator=g) * 0.3, torch.randn(64, 5, generator=g)
    y = torch.randint(0, 3, (12,), generator=g)
    seen: list[torch.Tensor] = []
    accumulate = PerExampleClipper.accumulate

    def spy(self: PerExampleClipper, *inputs: torch.Tensor):  # type: ignore[no-untyped-def]
        result = accumulate(self, *inputs)
        seen.append(result.norms)
        return result

    monkeypatch.setattr(PerExampleClipper, "accumulate", spy)
    stds: list[float] = []
    monkeypatch.setattr(  # the heads' noise is the engine's (keyed by the head's secret)
        training.dp.engine, "add_gaussian_noise", lambda flat, std, seed, step: stds.append(std)
    )
    cfg = ProbeConfig(
        encoder="",
        data="",
        dataset_name="test/points",
        epsilon=2.0,
        epochs=1,
        warmup_epochs=0,
        optimizer="sgd",
        lr=0.5,
        max_grad_norm=0.3,
        batch_size=12,
        seed=3,
    )
    trained, dp = fit_probe(x, y, 3, cfg, public_x=public)  # batch = n: q = 1, one step, all of x
    allowance = rounding_allowance(sample_bound(len(x), 1.0), FP64_CAPPED)
    assert dp["mechanism_params"] == {ROUNDING_TERMS: 12, ROUNDING_SUM: FP64_CAPPED}
    assert dp["sensitivity"] == cfg.max_grad_norm * allowance
    assert stds == [dp["sigma"] * dp["sensitivity"]]  # weight and bias: sigma C (1 + ...)
    torch.manual_seed(cfg.seed)
    head = LinearProbe(5, 3)  # the initialisation fit_probe starts from
    head.norm.running_mean.copy_(public.mean(0))
    head.norm.running_var.copy_(public.var(0, unbiased=False))
    head.eval()
    start = torch.cat([p.detach().flatten() for p in head.linear.parameters()])
    lone, clipped = [], torch.zeros_like(start)
    for i in range(len(x)):
        head.zero_grad()
        torch.nn.functional.cross_entropy(head(x[i : i + 1]), y[i : i + 1]).backward()
        grad = torch.cat([p.grad.flatten() for p in head.linear.parameters()])
        lone.append(grad.norm())
        clipped += grad * min(1.0, cfg.max_grad_norm / (grad.norm().item() + 1e-6))
    assert len(seen) == 1 and len(seen[0]) == len(x)
    assert torch.allclose(seen[0].float(), torch.stack(lone), rtol=1e-4)  # q = 1: in order
    assert max(lone) > cfg.max_grad_norm  # some examples are clipped
    end = torch.cat([p.detach().flatten() for p in trained.linear.parameters()])
    torch.testing.assert_close(end, start - cfg.lr * clipped / len(x), rtol=1e-4, atol=1e-6)


def test_few_shot_keeps_records_at_its_rate_and_bad_input_is_named(
    tiny_repo: Path, digits, tmp_path: Path
) -> None:
    train, _ = digits
    named = {"encoder": str(tiny_repo), "dataset_name": "test/digits-train"}
    r = run_probe(
        ProbeConfig(data=str(train), few_shot_rate=50 / 1437, epochs=5, export=False, **named)
    )
    assert (
        15 <= r.train_size <= 90 and r.repo is None and 200 <= r.test_size <= 380
    )  # keyed Bernoulli choices
    with pytest.raises(ValueError, match="head name"):
        run_probe(ProbeConfig(data=str(train), head="../evil", **named))
    with pytest.raises(ValueError, match="optimizer"):
        run_probe(ProbeConfig(data=str(train), optimizer="adam", epochs=1, export=False, **named))
    with pytest.raises(ValueError, match="dataset_name"):
        ProbeConfig(encoder=str(tiny_repo), data=str(train))  # a declared name, never the folder's
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "a.png").write_bytes((train / "0").iterdir().__next__().read_bytes())
    with pytest.raises(ValueError, match="one subfolder per class"):
        run_probe(ProbeConfig(data=str(flat), export=False, **named))


def test_a_dp_heads_labels_are_the_public_test_datas_whatever_private_records_are_present(
    tiny_repo: Path, digits, tmp_path: Path
) -> None:
    """The labels a DP head releases (their names, its outputs) are the PUBLIC --test-data's
    classes: removing the one private record of a class changes neither (they were the classes
    present in --data, so the head told whether that record was there); a private record of a
    class the public data lacks is named."""
    train, test = tmp_path / "train", digits[1]
    shutil.copytree(digits[0], train)
    lone = sorted((train / "9").glob("*.png"))
    for png in lone[1:]:
        png.unlink()
    named = {"encoder": str(tiny_repo), "dataset_name": "test/digits-train", "head": "h"}
    dp = {"epsilon": 2.0, "optimizer": "sgd", "epochs": 1, "warmup_epochs": 0}
    released = []
    for world in ("with", "without"):
        if world == "without":
            lone[0].unlink()
        out = tmp_path / world
        run_probe(ProbeConfig(data=str(train), test_data=str(test), out=str(out), **named, **dp))
        head, info = load_head(out, "h")
        released.append((info.labels, head.linear.out_features))
    assert released == [([str(d) for d in range(10)], 10)] * 2
    (train / "extra").mkdir()
    shutil.copy(next((train / "0").glob("*.png")), train / "extra" / "x.png")
    with pytest.raises(DataError, match="extra"):
        run_probe(ProbeConfig(data=str(train), test_data=str(test), export=False, **named, **dp))


def test_a_dp_heads_labels_without_test_data_are_declared_never_the_private_folders(
    tiny_repo: Path, digits, tmp_path: Path
) -> None:
    """Without --test-data a DP head's labels were --data's non-empty class folders: a class
    whose only private records are gone released a head of 9 labels instead of 10, a
    deterministic function of the private data. Such a head is refused unless --classes
    declares its labels publicly (a private class folder outside them stays a DataError); with
    --test-data, --classes must be its classes."""
    train, test = tmp_path / "train", digits[1]
    shutil.copytree(digits[0], train)
    for png in (train / "9").glob("*.png"):
        png.unlink()  # the class folder is empty: its private records are gone
    named = {"encoder": str(tiny_repo), "dataset_name": "test/digits-train", "head": "h"}
    dp = {"epsilon": 2.0, "optimizer": "sgd", "epochs": 1, "warmup_epochs": 0}
    with pytest.raises(ConfigError, match=r"--classes.*--test-data"):
        run_probe(ProbeConfig(data=str(train), export=False, **named, **dp))
    declared = [str(d) for d in range(10)]
    out = tmp_path / "declared"
    run_probe(ProbeConfig(data=str(train), classes=",".join(declared), out=str(out), **named, **dp))
    head, info = load_head(out, "h")
    assert (info.labels, head.linear.out_features) == (declared, 10)
    with pytest.raises(DataError, match="9"):
        run_probe(
            ProbeConfig(data=str(digits[0]), classes=declared[:9], export=False, **named, **dp)
        )
    with pytest.raises(ConfigError, match="--classes.*--test-data"):
        run_probe(
            ProbeConfig(data=str(train), test_data=str(test), classes="0,1", export=False, **named)
        )
    from training.skeleton.config import config_from_args
    from vip_hub.cli.main import build_parser

    def cli(classes: str) -> ProbeConfig:
        argv = ["probe", "--encoder=e", "--data=d", "--dataset-name=test/d", f"--classes={classes}"]
        return config_from_args(ProbeConfig, build_parser().parse_args(argv))

    assert cli("cat, dog,bird").declared_classes == ["cat", "dog", "bird"]
    with pytest.raises(ConfigError, match="--classes.*twice"):
        cli("a,b,a")


def test_a_probe_head_classifies_through_the_service(hub, tiny_repo: Path, digits) -> None:
    train, test = digits
    run_probe(
        ProbeConfig(
            encoder=str(tiny_repo),
            data=str(train),
            test_data=str(test),
            head="digits",
            epochs=15,
            warmup_epochs=2,
            dataset_name="test/digits-train",
        )
    )
    push_repo(tiny_repo, "vip/probe-test", token=WRITE_TOKEN)
    images = sorted((test / "3").glob("*.png"))[:4]
    r = httpx.post(
        f"{hub.url}/v1/classify",
        timeout=60,
        json={
            "model": "vip/probe-test",
            "head": "digits",
            "top_k": 3,
            "input": [base64.b64encode(p.read_bytes()).decode() for p in images],
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["data"]) == 4 and all(len(row["labels"]) == 3 for row in body["data"])
    assert {x["label"] for row in body["data"] for x in row["labels"]} <= {
        str(d) for d in range(10)
    }
    head = body["privacy"][
        "head"
    ]  # trained without DP on the labelled digits: no guarantee, named as such
    assert (
        head["epsilon"] is None
        and head["private_data"]
        and head["unprotected_datasets"] == ["test/digits-train"]
    )


def dp_accounting_epsilon(ledger: PrivacyLedger, component: str, delta: float) -> float:
    """The composition of every DP stage ``component`` depends on, from the raw (q, sigma, T) by
    dp_accounting's RDP accountant (not through vip_hub's own composition code)."""
    runs = tuple(
        (s.sample_rate, s.noise_multiplier, s.steps)
        for s in ledger.dp_stages()
        if s.component in (ENCODER, component)
    )
    return _rdp_epsilon(runs, delta)


@cache
def _rdp_epsilon(runs: tuple[tuple[float, float, int], ...], delta: float) -> float:
    """dp_accounting's RDP epsilon of the Poisson-sampled Gaussian ``runs`` (q, sigma, T), once
    per composition (each repo's encoder is asked for by three served blocks)."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import RdpAccountant

    acc = RdpAccountant()
    for q, sigma, steps in runs:
        acc.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    return acc.get_epsilon(delta)


def cards_are_composed_on_the_dataset_page(store: Path, repos: dict[str, Path]) -> None:
    """Every figure a card releases is a published repo's, and the dataset's page composes every
    DP stage of those repos: what the cards show, the page accounts for."""
    from support.live import ThreadedServer, settings_for

    from vip_hub.privacy.accounting import Accountant
    from vip_hub.privacy.ledger import compose_releases

    stages = [s for repo in repos.values() for s in PrivacyLedger.read(repo).dp_stages()]
    rows = [card_info((repo / CARD_FILE).read_text()).comparison for repo in repos.values()]
    assert all(r == rows[0] for r in rows) and rows[0]
    assert {r["repo"] for r in rows[0]} <= {f"vip/{name}" for name in repos}, rows[0]
    with ThreadedServer(settings_for(store)) as server:
        page = httpx.get(f"{server.url}/datasets/{FASHION_MNIST_TRAIN}", timeout=60).text
        delta = server.settings.hub.delta
    for name in repos:
        assert f'href="/vip/{name}"' in page
    composed = compose_releases(stages, delta, [Accountant.RDP])[Accountant.RDP]
    assert f"ε = {shown_epsilon(composed)} (RDP)" in page, page


def served_guarantees_hold(store: Path, repos: dict[str, Path], images: Path) -> None:
    """Each component's served guarantee (the privacy blocks of /v1/embeddings and /v1/classify,
    the card's headline) is at least the composition of its DP stages."""
    from support.live import ThreadedServer, settings_for

    image = base64.b64encode(min(images.glob("*/*.png")).read_bytes()).decode()
    with ThreadedServer(settings_for(store)) as server:
        for name, repo in repos.items():
            ledger = PrivacyLedger.read(repo)
            model = f"vip/{name}"
            emb = httpx.post(
                f"{server.url}/v1/embeddings", json={"model": model, "input": [image]}, timeout=60
            )
            cls = httpx.post(
                f"{server.url}/v1/classify",
                json={"model": model, "head": HEAD, "input": [image]},
                timeout=60,
            )
            assert emb.status_code == cls.status_code == 200, (emb.text, cls.text)
            if name == "vip-nano-syn":  # the raw-pixel baseline's head, served as any other
                raw = httpx.post(
                    f"{server.url}/v1/classify",
                    json={"model": model, "head": PIXELS_HEAD, "input": [image]},
                    timeout=60,
                )
                assert raw.status_code == 200, raw.text
                served = raw.json()["privacy"]["head"]
                truth = dp_accounting_epsilon(
                    ledger, head_component(PIXELS_HEAD), served["delta"] or 1e-5
                )
                assert 3.0 >= served["epsilon"] >= truth * (1 - 1e-3), (served, truth)
            for privacy, component in (
                (emb.json()["privacy"], ENCODER),
                (cls.json()["privacy"]["encoder"], ENCODER),
                (cls.json()["privacy"]["head"], head_component(HEAD)),
            ):
                truth = dp_accounting_epsilon(ledger, component, privacy["delta"] or 1e-5)
                assert privacy["epsilon"] >= truth * (1 - 1e-3), (name, component, privacy, truth)
            head = ledger.summary(head_component(HEAD))
            assert head.epsilon >= dp_accounting_epsilon(
                ledger, head_component(HEAD), head.delta
            ) * (1 - 1e-3)
            assert (
                head.epsilon > ledger.stage(f"linear-probe-dp:{HEAD}").epsilon
                or name.endswith("-syn")  # a prior: its head is its only stage on the data
            )
            card = (repo / CARD_FILE).read_text()
            headline = card.split("| Privacy |")[1].split("\n")[0]
            enc_eps = ledger.summary().epsilon
            shown = f"ε = {shown_epsilon(enc_eps)}" if enc_eps else "no private data"
            assert shown in headline, headline


@pytest.mark.slow
def test_main_job_trains_compares_publishes_and_skips_done_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The job on generated Fashion-MNIST IDX files (300 train, 100 test records): the first 240
    train records are the private dataset, test records 0-19 choose the feature modes and centre
    the heads and 20-99 measure top-1, every DP stage declares them, each released classifier
    (encoder and head) composes to the total epsilon by the split rule, the cards and the summary
    carry the published repos' DP heads only (zero-shot when above chance), the dataset page
    composes them all, and everything is signed, published and served."""
    idx = write_fashion(tmp_path / "idx", {"train": 300, "test": 100})
    cfg = MainJobConfig(
        work_dir=str(tmp_path / "run"),
        store=str(tmp_path / "hub"),
        port=free_port(),
        data=str(idx),
        train_size=240,
        test_size=80,
        select_size=20,
        dp_steps=3,
        dpcap_steps=2,
        dp_batch_size=32,
        contrastive_steps=2,
        contrastive_batch_size=8,
        probe_epochs=3,
        workers=0,
        serve=False,
    )
    assert run_main_job(cfg) == 0
    out = capsys.readouterr().out
    (verdict,) = [line for line in out.splitlines() if "dpcap-nano-fashion-dp zero-shot:" in line]
    assert "interval" in verdict and "on 80 records; chance, the largest class's share" in verdict
    zero_shot_above = verdict.endswith(": above chance")
    run = tmp_path / "run"
    data = run / "fashion-mnist"
    private = fashion_mnist("train", data)  # the job's image folders, read back
    first = fashion_mnist("train", idx).first(240)
    assert sorted(im.tobytes() for im in private.images) == sorted(
        im.tobytes() for im in first.images
    )  # the private records are the first 240 of the IDX file, no others
    measured = fashion_mnist("test", idx).images[20:100]  # after the 20 that choose modes
    assert sorted(im.tobytes() for im in fashion_mnist("test", data).images) == sorted(
        im.tobytes() for im in measured
    )
    select = fashion_mnist("test", idx).first(20)  # choose modes, centre every head
    repos = {e.name: run / e.name for e in PUBLISHED}
    for repo in repos.values():
        head, info = load_head(repo, HEAD)
        shared = load_encoder(repo).embed([select.pil(i) for i in range(20)], info.pooling)
        assert torch.allclose(head.norm.running_mean, shared.mean(0), atol=1e-4)
        assert torch.allclose(head.norm.running_var, torch.ones_like(head.norm.running_var))
    assert list(repos) == [
        "vip-nano-syn",
        "vip-nano-fashion-dp",
        "dpcap-nano-syn",
        "dpcap-nano-fashion-dp",
        "vip-nano-fashion-logit-dp",
        "vip-nano-fashion-naive-dp",
    ]
    for repo in repos.values():
        assert verify_repo(repo).ok
        card = (repo / CARD_FILE).read_text()
        assert "Linear-probe comparison" in card and "raw pixels: vip-nano-syn" in card
        # the comparison is in the card's front matter (YAML folds its long lines) and in its
        # table: every encoder's row says its feature mode was chosen on the 20 selection
        # records, scored on its (Syn) encoder's features (vip-nano-syn for the ViP family,
        # dpcap-nano-syn for (Syn)-DP-Cap and DP-Cap)
        words = " ".join(card.split())
        assert words.count("modes on public test records 0-19, scored on vip-nano-syn)") == 2 * 4
        assert words.count("modes on public test records 0-19, scored on dpcap-nano-syn)") == 2 * 2
        for e in PUBLISHED:
            assert f"{e.label}: {e.name}" in card
        # zero-shot beside the heads only when its binomial test puts it above chance
        assert ("DP-Cap zero-shot: dpcap-nano-fashion-dp" in card) == zero_shot_above, out
        assert f"-DP on {FASHION_MNIST_TRAIN} [RDP]" in card
        assert (
            "non-private head" not in card and "top1_nonprivate" not in card
        )  # figures without a guarantee
        assert list_heads(repo) == ([HEAD, PIXELS_HEAD] if repo.name == "vip-nano-syn" else [HEAD])
        assert f"publish vip/{repo.name}" in out
        assert (
            verify_signature(repo, load_keys([run / "signing" / "main-job.pub"])).name == "main-job"
        )
        # the split rule: the encoder's stages and the head's compose to the total epsilon
        head = PrivacyLedger.read(repo).summary(head_component(HEAD))
        assert 3.0 - 0.02 < head.epsilon <= 3.0 and head.delta == pytest.approx(1e-5)
    mechanisms = {  # and the DP-AdamW peak lr: a quarter of the recipe's 3.84e-4 and 5.12e-4
        "vip-nano-fashion-dp": ("dp-pretrain", "DP-AdamW", 9.6e-5),
        "dpcap-nano-fashion-dp": ("dp-captioning", "DP-AdamW", 1.28e-4),
        "vip-nano-fashion-logit-dp": ("dp-contrastive", "Logit-DP", None),
        "vip-nano-fashion-naive-dp": ("dp-contrastive", "Naive-DP", None),
    }
    for name, (stage_name, mechanism, lr) in mechanisms.items():
        ledger = PrivacyLedger.read(repos[name])
        enc = ledger.stage(stage_name)
        assert enc.mechanism == mechanism and enc.audit is not None
        # d counts tensors named where they are released (verify checked them) and the canaries
        files = {k.partition(":")[0] for k in enc.noised_tensors or {}}
        assert WEIGHTS_FILE in files and "canaries" in files, enc.noised_tensors
        assert ("unreleased" in files) == (stage_name == "dp-contrastive")  # projection head
        if lr is not None:
            assert enc.hyperparameters["lr"] == pytest.approx(lr)
        assert enc.dataset.name == FASHION_MNIST_TRAIN and enc.dataset.size == 240
        assert enc.epsilon <= cfg.encoder_epsilon and enc.delta == pytest.approx(1e-5)
        head_stage = ledger.stage(f"linear-probe-dp:{HEAD}")
        assert head_stage.dataset.size == 240 and 1.0 < head_stage.epsilon < 3.0
    scoring = fashion_mnist("test", data)  # the job's scoring records, read back
    released = [(repo, HEAD) for repo in repos.values()] + [(repos["vip-nano-syn"], PIXELS_HEAD)]
    for repo, name in released:  # the top-1 the card states is the released head's, recomputed
        head, info = load_head(repo, name)
        x = load_encoder(repo).embed([scoring.pil(i) for i in range(len(scoring))], info.pooling)
        right = head(x).argmax(1) == torch.as_tensor(scoring.labels)
        assert right.double().mean().item() == pytest.approx(info.metrics["top1"], abs=1e-9)
    for repo, name in released:  # every head draw is a stage of the head, released as their mean
        stages = [s for s in PrivacyLedger.read(repo).stages if s.component == head_component(name)]
        assert [s.name.rpartition(":")[2] for s in stages] == [name, "draw-2", "draw-3"]
        assert (
            len({s.noise_multiplier for s in stages}) == 1 and len({s.run_id for s in stages}) == 3
        )
        assert all(k.startswith("unreleased:") for s in stages[1:] for k in s.noised_tensors)
    assert (repos["dpcap-nano-fashion-dp"] / VOCAB_FILE).exists()
    assert "Top-1 on public Fashion-MNIST test records 20 to 99 (the first 20 chose" in out
    # one choice per (Syn) encoder, read by every head of the encoders trained from it
    assert out.count("modes on public records:") == 3  # the (Syn) encoders' and raw pixels'
    assert "raw pixels: modes on public records: pixels" in out
    for prior in ("vip-nano-syn", "dpcap-nano-syn"):  # an encoder's mode reads the encoder
        assert "pixels" not in out.split(f"{prior}: modes on public records")[1].split("\n")[0]
    assert "vip-nano-syn: modes on public records" in out
    assert "dpcap-nano-syn: modes on public records" in out
    comparison = json.loads((run / "comparison.json").read_text())
    rows = comparison["rows"]
    # each DP-trained encoder paired against the published prior it was trained from
    pairs = [line.split(":")[0] for line in comparison["against_prior"]]
    assert pairs == [
        "vip-nano-fashion-dp - vip-nano-syn",
        "dpcap-nano-fashion-dp - dpcap-nano-syn",
        "vip-nano-fashion-logit-dp - vip-nano-syn",
        "vip-nano-fashion-naive-dp - vip-nano-syn",
    ]
    assert all(line in out and "; z " in line for line in comparison["against_prior"])
    # every encoder paired against the raw-pixel baseline, a head of the (Syn)-ViP repo that reads
    # no weight: its guarantee is its own three draws' at the whole budget
    assert [line.split(":")[0] for line in comparison["against_pixels"]] == [
        f"{e.name} - raw pixels" for e in PUBLISHED
    ]
    assert all(line in out and "; z " in line for line in comparison["against_pixels"])
    raw = PrivacyLedger.read(repos["vip-nano-syn"]).summary(head_component(PIXELS_HEAD))
    assert 3.0 - 0.02 < raw.epsilon <= 3.0
    assert load_head(repos["vip-nano-syn"], PIXELS_HEAD)[1].pooling == "pixels"
    for row in rows:  # each head row carries its three draws' top-1 beside its mean head's
        if "zero-shot" not in row["model"]:
            assert len(row["draws"]) == 3, row
            assert f"{row['top1']:.4f}  {row['model']}  (draws " in out
    assert "each DP head drawn 3 times from fresh secrets" in out and "their mean released" in out
    card = (repos["vip-nano-fashion-dp"] / CARD_FILE).read_text()
    assert "every draw's top-1 is in brackets" in card and "(draws " in card
    vip_family = {
        r["features"].split()[0]
        for r in rows
        if "vip-nano" in r["model"] and not r["model"].startswith("raw pixels")
    }
    assert len(vip_family) == 1, rows  # (Syn)-ViP, ViP, Logit-DP and Naive-DP read one mode
    assert "Job wall time" in out and "load average" in out
    assert "serve --store" in out and "--no-inference" in out  # publishing alone: the hub only
    assert (
        "HF_ENDPOINT=http://127.0.0.1:" in out and "/v1/embeddings" in out and "/v1/captions" in out
    )
    assert 'timm.create_model("hf-hub:vip/vip-nano-fashion-dp"' in out

    served_guarantees_hold(tmp_path / "hub", repos, data / "test")
    cards_are_composed_on_the_dataset_page(tmp_path / "hub", repos)

    # a head setting changed: the comparison runs again on repos holding the earlier heads,
    # which the new ones replace (each composed with the encoder alone, not with the old head)
    cfg.port, cfg.probe_epochs = free_port(), 2
    assert run_main_job(cfg) == 0, capsys.readouterr().out
    for repo in repos.values():
        head = PrivacyLedger.read(repo).summary(head_component(HEAD))
        assert 3.0 - 0.02 < head.epsilon <= 3.0 and HEAD in list_heads(repo)

    # `vip-hub run` with the same settings, serving: everything is up to date, including what is
    # published; then SIGTERM (docker stop): its server child stops as on Ctrl-C
    cfg.port, cfg.serve = free_port(), True
    toml = tmp_path / "run.toml"
    toml.write_text(
        "".join(f"{k} = {json.dumps(v)}\n" for k, v in cfg.model_dump().items() if v is not None)
    )
    job = subprocess.Popen(
        [str(Path(sys.executable).with_name("vip-hub")), "run", "--config", str(toml)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    watchdog = threading.Timer(300, job.kill)
    watchdog.start()
    try:
        assert job.stdout is not None
        lines = []
        for line in job.stdout:
            lines.append(line)
            if line.startswith("Serving;"):
                break
        assert "".join(lines).count("up to date, skipped") == 14, "".join(lines)
        health = f"http://127.0.0.1:{cfg.port}/healthz"
        assert httpx.get(health).status_code == 200, "".join(lines)
        job.send_signal(signal.SIGTERM)
        assert job.wait(60) == 130, job.stdout.read()  # the CLI's exit status for an interrupt
        with pytest.raises(httpx.ConnectError):
            httpx.get(health)
    finally:
        watchdog.cancel()
        job.kill()


def test_docker_files_name_what_exists() -> None:
    for name in ("Dockerfile", "Dockerfile.gpu"):
        text = (ROOT / "docker" / name).read_text()
        assert "USER vip" in text and "HEALTHCHECK" in text and "/healthz" in text
        assert "torch==2.14.1" in text and "VIP_HUB_STORE=/data/hub" in text
        for line in text.splitlines():
            if line.startswith("COPY "):
                for src in line.split()[1:-1]:
                    assert (ROOT / src).exists(), f"{name}: COPY {src} does not exist"
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    assert (
        compose["services"]["hub"]["volumes"] == ["hub-data:/data"]
        and "hub-data" in compose["volumes"]
    )


def test_a_class_means_head_is_released_with_its_draws_in_stages_verify_recomputes(
    tiny_repo: Path, digits
) -> None:
    """The study's class-means head drawn ``head_draws`` times on an encoder's features of the
    labelled digits, the draws' mean head saved into the repo with every draw's stage: each is a
    one-step stage (q = 1) from a fresh secret, the draws whose weights no file holds name
    their noise unreleased, together they spend the study's epsilon on the digits (the
    encoder's DP stage is on other data; one draw alone far less), and ``vip-hub verify``
    recomputes and accepts the claim."""
    from training.recipes.probe import load_labelled
    from training.study.config import JOB, StudyConfig
    from training.study.heads import dp_head, dp_head_draws
    from vip_hub.repo.heads import HeadInfo, save_head
    from vip_hub.repo_format import head_component

    train, _ = digits
    data = load_labelled(train, "test/digits-train")
    encoder = load_encoder(tiny_repo)
    x = encoder.embed(data.images, "vip")
    y = torch.as_tensor(data.labels)
    study = StudyConfig(**{**JOB.model_dump(), "class_means_components": 16})
    drawn = dp_head_draws(
        partial(
            dp_head, study, x, y, x[:200], data.dataset, 10,
            name="means", pooling="vip", kind="class-means",
        ),
        study.head_draws,
    )  # fmt: skip
    fits = drawn.draws
    assert len(fits) == study.head_draws == 3
    assert not torch.equal(fits[0].head.linear.weight, fits[1].head.linear.weight)
    # the head released is the draws' mean: its logits are the mean of theirs
    logits = torch.stack([f.head(x) for f in fits]).mean(0)
    assert torch.allclose(drawn.head(x), logits, atol=1e-4)
    ledger = save_head(
        tiny_repo,
        drawn.head,
        HeadInfo("means", "vip", data.classes),
        fits[0].stage,
        draws=drawn.stages[1:],
    )
    released = ledger.stage("class-means-dp:means")
    draws = [ledger.stage(f"class-means-dp:means:draw-{i}") for i in (2, 3)]
    for stage in (released, *draws):
        assert isinstance(stage, DPStage) and stage.component == head_component("means")
        assert (stage.sample_rate, stage.steps) == (1.0, 1)
        assert stage.noise_multiplier == pytest.approx(released.noise_multiplier)
        assert sum(stage.noised_tensors.values()) == released.noised_dimension
    assert all(k.startswith("unreleased:") and f"draw {i} of 3" in k
               for i, s in enumerate(draws, 2) for k in s.noised_tensors)  # fmt: skip
    assert len({s.run_id for s in (released, *draws)}) == 3
    report = verify_repo(tiny_repo)
    assert report.ok, report.problems
    guarantee = next(g for g in ledger.guarantees if g.dataset == data.dataset.name)
    assert guarantee.epsilon == pytest.approx(study.epsilon, abs=0.01)
    summary = ledger.summary(head_component("means"))
    assert next(g for g in summary.guarantees if g.dataset == data.dataset.name) == guarantee
    assert released.epsilon < 0.6 * study.epsilon  # one draw of three (RDP: 1.63 of 3)
    assert (drawn.head(x).argmax(1) == y).float().mean() > 0.5
    assert "the mean of the 3 draws' heads" in released.description


def test_a_steps_duration_carries_its_rounded_seconds_into_the_minutes() -> None:
    assert _duration(59.96) == "1:00.0"  # was printed "0:60.0"
    assert [_duration(s) for s in (0.04, 12.54, 125.0, 3599.95)] == [
        "0:00.0",
        "0:12.5",
        "2:05.0",
        "60:00.0",
    ]


def test_a_step_whose_audit_flags_it_twice_says_the_engine_is_broken(tmp_path):
    """A DP step reaches the job flagged only after ``retrained_if_flagged`` trained it again from
    a fresh secret: the refusal says nothing was released and names the run folder to report; any
    other failure says to resume."""
    steps = _Steps(tmp_path)
    out = tmp_path / "vip-nano-fashion-dp"

    def flagged() -> None:
        raise AuditError(["the empirical lower bound exceeds the accounted epsilon"])

    with pytest.raises(StepFailed) as failed:
        steps.run("ViP", {}, [out], flagged)
    message = str(failed.value)
    assert "Nothing was released" in message and f"with the run folder ({out}.run)" in message
    assert "resumes from its last checkpoint" not in message
    with pytest.raises(StepFailed, match="resumes from its last checkpoint"):
        steps.run("ViP", {}, [out], lambda: 1 / 0)


def test_the_job_without_the_serve_extra_says_so_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job publishes through a hub it starts (`vip-hub serve`): with the ``train`` extra
    alone it trained every encoder, then failed as the server exited. It now says what to
    install before writing anything."""
    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if the serve extra were not installed
    monkeypatch.setattr(  # the job's first step, which a missing check would reach in a moment
        "training.main_job._Steps", lambda work: pytest.fail("the job began before refusing")
    )
    work = tmp_path / "run"
    with pytest.raises(ConfigError) as refused:
        run_main_job(MainJobConfig(work_dir=str(work), store=str(tmp_path / "hub")))
    message = str(refused.value)
    assert "`vip-hub serve` cannot run here" in message and "vip-hub[serve]" in message, message
    assert "pip install 'vip-hub[all]'" in message and not work.exists()
