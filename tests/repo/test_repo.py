"""The released-encoder repo format, end to end: export, plain-timm load, verify, tamper."""

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import yaml
from huggingface_hub import EvalResult, ModelCard
from PIL import Image
from safetensors.torch import load_file, save_file
from support.helpers import (
    TINY,
    WIDE_GREY,
    add_audit_record,
    dp_stage,
    restate_truncation,
    rewrite_ledger_copies,
    staged_reports,
    swap_after_verify,
    synthetic_stage,
    tiny_encoder,
    tiny_repo_with_head,
    turned_jpeg,
    wide_grey,
)

from vip_hub import PrivacyLedger, export_encoder, load_encoder, update_repo, verify_repo
from vip_hub.cli.main import main
from vip_hub.errors import (
    ConfigError,
    LedgerError,
    RepoFormatError,
    TamperedFileError,
    UnsafePathError,
    VerificationError,
    VipHubError,
)
from vip_hub.models.encoders import ARCHS, EncoderSpec, create_encoder, encoder_shapes
from vip_hub.privacy.accounting import NOISE_SAMPLERS, truncation_delta
from vip_hub.privacy.ledger import (
    MAX_STAGES,
    NOT_RELEASED,
    Dataset,
    DPStage,
    NonPrivateStage,
    noised_key,
    rounding_before_2026_12_03,
)
from vip_hub.privacy.sensitivity import (
    CONTRASTIVE_LOSS,
    DP_ADAMW,
    rounding_params,
    sample_bound,
    sensitivity,
)
from vip_hub.repo.artifacts import (
    digest_file,
    read_safetensors_header,
    read_safetensors_metadata,
    rewrite_safetensors_metadata,
)
from vip_hub.repo.card import card_statements, load_card
from vip_hub.repo.files import META_LEDGER
from vip_hub.repo_format import (
    CARD_FILE,
    CARD_LEDGER_KEY,
    CONFIG_BLOCK,
    CONFIG_FILE,
    HEAD_LABELS,
    HEAD_METRICS,
    HEAD_WEIGHTS_GLOB,
    LEDGER_FILE,
    MAE_DECODER_FILE,
    META_ARCH,
    META_DECODER,
    META_FORMAT,
    META_IN_FEATURES,
    META_LABELS,
    META_POOLING,
    METRICS_POOLING,
    SIGNATURE_FILE,
    WEIGHTS_FILE,
    WEIGHTS_SUFFIX,
    head_component,
    head_file,
    head_name_of,
)

PLAIN_TIMM = r"""
import sys, timm, torch
model = timm.create_model(f"local-dir:{sys.argv[1]}", pretrained=True).eval()
assert not any(m.startswith("vip_hub") for m in sys.modules), "vip_hub was imported"
x = torch.load(sys.argv[2])
with torch.no_grad():
    torch.save(model(x), sys.argv[3])
cfg = timm.data.resolve_data_config({}, model=model)
print(cfg["input_size"], cfg["interpolation"], cfg["crop_pct"])
"""


def test_export_layout(tiny_repo):
    names = {p.name for p in tiny_repo.iterdir()}
    assert names == {WEIGHTS_FILE, CONFIG_FILE, LEDGER_FILE, CARD_FILE, MAE_DECODER_FILE}
    config = json.loads((tiny_repo / CONFIG_FILE).read_text())
    assert config["architecture"] == "vit_tiny_patch16_224" and config["num_classes"] == 0
    assert config["num_features"] == 192 and config["global_pool"] == "avg"
    assert config["model_args"]["num_heads"] == 12 and config["model_args"]["img_size"] == 32
    assert config["pretrained_cfg"]["input_size"] == [3, 32, 32]
    assert config[CONFIG_BLOCK]["feature_dims"] == {
        "vip": 1152,
        "avg": 192,
        "cls": 192,
        "spatial-b4-g2": 768,  # the default spatial modes: a 2 x 2 patch grid at 32 px
        "spatial-b8-g2": 768,
    }
    meta = read_safetensors_metadata(tiny_repo / WEIGHTS_FILE)
    assert meta[META_ARCH] == "vip-nano" and meta[META_FORMAT] == "1"
    assert PrivacyLedger.parse(meta[META_LEDGER]) == PrivacyLedger.parse(
        (tiny_repo / LEDGER_FILE).read_text()
    )


def test_plain_timm_loads_the_repo(tiny_repo, tmp_path):
    """Plain timm in a process of its own gives this process's forward bit for bit, at this
    process's thread count (another count sums in another order: about 1e-6 apart)."""
    x = torch.randn(2, 3, 32, 32)
    torch.save(x, tmp_path / "x.pt")
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            PLAIN_TIMM,
            str(tiny_repo),
            str(tmp_path / "x.pt"),
            str(tmp_path / "y.pt"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())},
    )
    assert r.returncode == 0, r.stderr
    assert "(3, 32, 32) bicubic 0.875" in r.stdout
    with torch.no_grad():
        expected = tiny_encoder()(x)
    torch.testing.assert_close(torch.load(tmp_path / "y.pt"), expected, rtol=0, atol=0)


def test_load_encoder(tiny_repo):
    enc = load_encoder(tiny_repo)
    assert enc.spec.arch == "vip-nano" and enc.privacy.datasets == ("test-images",)
    from PIL import Image

    imgs = [Image.new("RGB", (40, 30), (i * 60, 20, 200)) for i in range(3)]
    feats = enc.embed(imgs, pooling="vip")
    assert feats.shape == (3, 1152)
    batch = enc.preprocess(imgs)
    assert batch.shape == (3, 3, 32, 32)
    torch.testing.assert_close(enc.embed(batch, pooling="avg"), enc.model(batch))


def test_preprocess_reads_wide_greyscale_and_exif_orientation_as_seen(tiny_repo):
    """Images opened by the caller are preprocessed as the service decodes them: 16-bit and
    float greyscale as their 8-bit versions, a JPEG as its EXIF orientation shows it."""
    from PIL import Image

    enc = load_encoder(tiny_repo)
    pairs = [wide_grey(mode) for mode in WIDE_GREY] + [turned_jpeg()]
    opened = [Image.open(io.BytesIO(data)) for data, _ in pairs]
    seen = enc.preprocess([expected for _, expected in pairs])
    torch.testing.assert_close(enc.preprocess(opened), seen, rtol=0, atol=0)


def test_a_pixels_head_reads_the_preprocessed_image_and_verifies_by_the_input_size(
    tiny_repo, monkeypatch
):
    """Every repo offers ``pixels``: the preprocessed image, channels averaged, flattened, without
    a forward pass; a head on it saves and verifies by the configuration's input size (no
    ``feature_dims`` entry), and one of another width fails by that size."""
    from vip_hub.repo.heads import HeadInfo, LinearProbe, load_head, save_head

    enc = load_encoder(tiny_repo)
    images = [Image.fromarray(np.full((40, 30, 3), (10 * i, 80, 160), np.uint8)) for i in range(3)]
    x = enc.preprocess(images)
    assert "pixels" in enc.poolings and enc.feature_dim("pixels") == 32 * 32
    assert (
        "- `pixels` (1024): the preprocessed image's pixels" in (tiny_repo / CARD_FILE).read_text()
    )
    both = enc.embed(images, ("pixels", "avg"))
    torch.testing.assert_close(both["pixels"], x.mean(1).flatten(1))
    torch.testing.assert_close(both["avg"], enc.embed(images, "avg"))
    monkeypatch.setattr(enc.model, "forward_intermediates", None)  # pixels alone: no forward
    torch.testing.assert_close(enc.embed(x, "pixels"), x.mean(1).flatten(1))
    stage = NonPrivateStage(
        name="linear-probe:raw",
        component=head_component("raw"),
        dataset=Dataset(name="toy-labels", size=30),
        private_data=True,
    )
    head = LinearProbe(32 * 32, 3).eval()
    save_head(tiny_repo, head, HeadInfo("raw", "pixels", ["a", "b", "c"]), stage)
    assert verify_repo(tiny_repo).ok
    loaded, info = load_head(tiny_repo, "raw")
    assert info.pooling == "pixels"
    torch.testing.assert_close(loaded(both["pixels"]), head(both["pixels"]))
    staged_reports(monkeypatch)  # let the update write a head verify refuses
    save_head(tiny_repo, LinearProbe(28 * 28, 3), HeadInfo("raw", "pixels", ["a"] * 3), stage)
    _fails(tiny_repo, f"reads 784 features of mode 'pixels', which {CONFIG_FILE}'s "
           "pretrained_cfg.input_size makes 1024")  # fmt: skip


def test_spatial_modes_are_declared_per_repo(tiny_repo, tmp_path, dp_stage_session):
    """A repo offers the spatial modes its ``CONFIG_FILE`` declares, and only those; the card lists
    them; a declaration that does not fit the weights is refused."""
    enc = load_encoder(tiny_repo)
    assert enc.poolings == ("vip", "avg", "cls", "spatial-b4-g2", "spatial-b8-g2", "pixels")
    x = torch.randn(2, 3, 32, 32)
    feats = enc.embed(x, pooling="spatial-b8-g2")
    assert feats.shape == (2, 768) and enc.feature_dim("spatial-b8-g2") == 768
    torch.testing.assert_close(feats.mean(1), torch.zeros(2), atol=1e-5, rtol=0)
    for undeclared in ("spatial-b4.8-g2", "spatial-b5-g1", "max"):
        with pytest.raises(ValueError, match=r"this repo offers vip, avg, cls, spatial-b4-g2, "):
            enc.embed(x, pooling=undeclared)
    card = (tiny_repo / CARD_FILE).read_text()
    assert "`spatial-b8-g2` (768): patch tokens of block 8 average-pooled to a 2 x 2 grid" in card
    assert "small images and classes that live in the layout" in card
    chosen = export_encoder(
        tmp_path / "chosen",
        tiny_encoder(),
        TINY,
        [dp_stage_session],
        model_name="chosen",
        spatial=["spatial-b1.2-g1"],
    )
    assert load_encoder(chosen).poolings[3:] == ("spatial-b1.2-g1", "pixels")
    with pytest.raises(ValueError, match="block 13 of a 12-block encoder"):
        export_encoder(
            tmp_path / "bad", tiny_encoder(), TINY, [dp_stage_session], model_name="bad",
            spatial=["spatial-b13-g1"],
        )  # fmt: skip
    config = json.loads((chosen / CONFIG_FILE).read_text())
    config[CONFIG_BLOCK]["feature_dims"]["spatial-b1.2-g1"] = 192
    (chosen / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(RepoFormatError, match="spatial-b1.2-g1 is 384 wide, not 192"):
        load_encoder(chosen, verify=False)


def _redigest(repo: Path, *names: str) -> None:
    """Write files' new digests into the ledger's three copies, as a tamperer who owns the repo
    would."""

    def change(ledger: dict) -> dict:
        for name in names:
            ledger["artifacts"][name] = digest_file(repo / name, name)
        return ledger

    rewrite_ledger_copies(repo, change)


@pytest.mark.parametrize(
    "key, value, why",
    [
        ("num_params", "abc", "num_params is 'abc', not the"),
        ("num_params", 10**30, f"num_params is {10**30}, not the"),
        ("num_params", 7, "num_params is 7, not the"),
        ("num_params", 1e3, "num_params is 1000.0, not the"),
        ("feature_dims", "x", "feature_dims is 'x', not an object of feature modes"),
        ("feature_dims", {}, "feature_dims is {}, not an object of feature modes"),
        ("feature_dims", {"avg": "wide"}, "gives 'avg' the width 'wide', not a positive integer"),
        ("feature_dims", {"avg": True}, "gives 'avg' the width True, not a positive integer"),
        ("feature_dims", {"avg": 0}, "gives 'avg' the width 0, not a positive integer"),
        ("feature_dims", {"spatial-b2.1-g1": 3}, "list the blocks in increasing order"),
        ("arch", "vip-base", f"arch disagrees with {WEIGHTS_FILE} metadata ('vip-nano')"),
    ],
)
def test_a_config_block_its_weights_and_readers_cannot_back_is_refused(tiny_repo, key, value, why):
    """The hub's pages show ``num_params`` and the service's model list ``feature_dims``: such a
    repo (its config digest rewritten into its ledger) verified, then failed the hub's front page
    and /v1/models for every visitor. ``num_params`` is recomputed from the weights' header, and
    ``arch`` must be the one the weights' metadata names."""
    assert verify_repo(tiny_repo).ok
    config = json.loads((tiny_repo / CONFIG_FILE).read_text())
    config[CONFIG_BLOCK][key] = value
    (tiny_repo / CONFIG_FILE).write_text(json.dumps(config))
    _redigest(tiny_repo, CONFIG_FILE)
    _fails(tiny_repo, f"{CONFIG_FILE}: vip_hub.", why)


def test_head_labels_that_are_no_class_names_are_refused(tmp_path):
    repo = tiny_repo_with_head(tmp_path / "repo")
    labels_file, path = head_file("toy", HEAD_LABELS), repo / head_file("toy")
    (repo / labels_file).write_text("[1, 2, 3]")
    meta = read_safetensors_metadata(path)
    rewrite_safetensors_metadata(path, {**meta, META_LABELS: "[1, 2, 3]"})
    _redigest(repo, labels_file)
    _fails(repo, f"{head_file('toy')}: its labels are [1, 2, 3], not a list of class names")


def test_overwrite_replaces_a_released_repo_or_an_empty_folder_only(tmp_path):
    """``overwrite=True`` (``vip-hub import-mae --overwrite``) replaced whatever ``out_dir`` named:
    a folder of a user's files was deleted for the repo."""

    def export(out: Path) -> Path:
        return export_encoder(
            out, tiny_encoder(), TINY, [synthetic_stage()], model_name="r", overwrite=True
        )

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "thesis.tex").write_text("precious")
    with pytest.raises(ConfigError, match="docs exists and is not a released repo"):
        export(docs)
    assert (docs / "thesis.tex").read_text() == "precious"
    (tmp_path / "empty").mkdir()
    export(tmp_path / "empty")
    assert verify_repo(export(tmp_path / "empty")).ok  # the repo now there, replaced


def test_a_repo_behind_a_symbolic_link_is_written_where_it_points(tmp_path):
    """The swap renamed the new folder onto the link itself (NotADirectoryError): an export to an
    --out that is a link, or a head added through one, failed once the training was done."""
    from vip_hub.repo.heads import HeadInfo, LinearProbe, save_head

    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    link.symlink_to(real)
    export_encoder(link, tiny_encoder(), TINY, [synthetic_stage()], model_name="r", overwrite=True)
    assert link.is_symlink() and verify_repo(real).ok
    stage = NonPrivateStage(
        name="linear-probe:toy",
        component=head_component("toy"),
        dataset=Dataset(name="toy-labels", size=30),
        private_data=True,
    )
    save_head(link, LinearProbe(192, 3).eval(), HeadInfo("toy", "avg", ["a", "b", "c"]), stage)
    assert link.is_symlink() and (real / head_file("toy")).is_file() and verify_repo(link).ok


def test_card_parses_with_huggingface_hub(tiny_repo):
    card = ModelCard.load(tiny_repo / CARD_FILE)
    data = card.data.to_dict()
    assert load_card((tiny_repo / CARD_FILE).read_text()).to_dict() == data  # libyaml reads alike
    assert data["library_name"] == "timm" and "differential-privacy" in data["tags"]
    assert data["datasets"] == ["procedural-images", "test-images"]
    assert data[CARD_LEDGER_KEY]["schema"] == "vip-hub/privacy-ledger/v4"
    text = card.text
    for phrase in (
        "## Privacy guarantee",
        "differential privacy for the dataset `test-images`",
        "`synthetic-pretraining` (procedural-images)",
        "## How to use",
        "## Intended use and limitations",
        'timm.create_model("hf-hub:vip/vip-nano-test"',
    ):
        assert phrase in text


def test_verify_passes_and_cli(tiny_repo, capsys):
    report = verify_repo(tiny_repo)
    assert report.ok, report.problems
    assert "epsilon recomputed (rdp, prv, pld)" in report.checks
    assert main(["verify", str(tiny_repo), "--json"]) == 0, capsys.readouterr()  # `vip-hub verify`
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and all(
        out["recomputed"][f"dp-pretraining/{a}"] > 0 for a in ("rdp", "prv", "pld")
    )


def _fails(repo, *fragments):
    report = verify_repo(repo)
    assert not report.ok
    text = "; ".join(map(str, report.problems))
    for f in fragments:
        assert f in text, text
    assert main(["verify", str(repo)]) == 1
    return text


def _lower_epsilon(ledger: dict) -> dict:
    ledger["stages"][1]["epsilon"] = 0.5
    ledger["guarantees"][0]["epsilon"] = 0.5
    return ledger


def test_tampered_json_copy(tiny_repo):
    path = tiny_repo / LEDGER_FILE
    path.write_text(json.dumps(_lower_epsilon(json.loads(path.read_text()))))
    _fails(tiny_repo, f"disagrees with {LEDGER_FILE} at stages.1.epsilon")


def test_tampered_weights_metadata_copy(tiny_repo):
    path = tiny_repo / WEIGHTS_FILE
    meta = read_safetensors_metadata(path)
    meta[META_LEDGER] = json.dumps(_lower_epsilon(json.loads(meta[META_LEDGER])))
    rewrite_safetensors_metadata(path, meta)
    _fails(tiny_repo, f"{WEIGHTS_FILE}: its ledger copy disagrees", "stages.1.epsilon")


def test_tampered_card_copy(tiny_repo):
    path = tiny_repo / CARD_FILE
    _, front, body = path.read_text().split("---\n", 2)
    data = yaml.safe_load(front)
    data[CARD_LEDGER_KEY] = _lower_epsilon(data[CARD_LEDGER_KEY])
    path.write_text("---\n" + yaml.safe_dump(data, sort_keys=False) + "---\n" + body)
    _fails(tiny_repo, f"{CARD_FILE}: its ledger copy disagrees", "stages.1.epsilon")


def test_all_copies_lowered_consistently_fails_accounting(tiny_repo):
    rewrite_ledger_copies(tiny_repo, _lower_epsilon)
    _fails(
        tiny_repo,
        "stage 'dp-pretraining': claims epsilon 0.5 but the rdp accountant gives",
        "guarantee 'test-images'",
    )


def test_a_guarantee_stated_for_fewer_stages_than_it_composes_fails(tmp_path):
    """Two DP stages on one dataset, each stated truly, and a guarantee whose epsilon is the
    first one's alone: verify composes every stage the guarantee names."""
    more = dp_stage(steps=60).model_copy(update={"name": "dp-more"})
    stages = [synthetic_stage(), dp_stage(), more]
    repo = export_encoder(tmp_path / "two", tiny_encoder(), TINY, stages, model_name="two")

    def first_stage_only(ledger: dict) -> dict:
        (g,) = ledger["guarantees"]
        assert sorted(g["stages"]) == ["dp-more", "dp-pretraining"]
        g["epsilon"] = ledger["stages"][1]["epsilon"]
        return ledger

    rewrite_ledger_copies(repo, first_stage_only)
    _fails(repo, "guarantee 'test-images'", "composing stages")


def _unlist(name: str) -> Callable[[dict], dict]:
    def change(ledger: dict) -> dict:
        del ledger["artifacts"][name]
        return ledger

    return change


def _list_absent(ledger: dict) -> dict:
    ledger["artifacts"]["notes/absent.md"] = "sha256:" + "0" * 64
    return ledger


@pytest.mark.parametrize(
    "change, problem",
    [
        (_unlist(CONFIG_FILE), f"{CONFIG_FILE}: not listed in the ledger's artifacts"),
        (_unlist(WEIGHTS_FILE), f"{WEIGHTS_FILE}: not listed in the ledger's artifacts"),
        (_list_absent, "notes/absent.md: listed in the ledger's artifacts but missing"),
    ],
)
def test_the_ledgers_artifacts_are_the_repos_files(tmp_path, change, problem):
    """The configuration and every weights file are bound by a digest the ledger lists (one
    left out could be rewritten freely), and a file the ledger lists is in the repo."""
    stages = [synthetic_stage(), dp_stage()]
    repo = export_encoder(tmp_path / "r", tiny_encoder(), TINY, stages, model_name="r")
    rewrite_ledger_copies(repo, change)
    _fails(repo, problem)


def test_rounding_terms_below_the_sample_bound_fail(tmp_path):
    """The rounding allowance covers sums of up to ``rounding_terms`` examples; a stage whose
    terms fall below what a Poisson sample of its n at q may hold (``sample_bound``) states a
    sensitivity for smaller sums than its steps added, even if it is that of its terms."""
    n, q, params = 1000, 0.05, rounding_params(1000, 0.05)
    stage = DPStage.from_parameters(
        name="dp-pretraining",
        dataset=Dataset(name="test-images", size=n),
        sample_rate=q,
        noise_multiplier=1.0,
        steps=100,
        clipping_norm=0.1,
        noised_tensors={"unreleased:test": 1_000},
        mechanism_params=params,
        sensitivity=sensitivity(DP_ADAMW, 0.1, params),
    )
    stages = [synthetic_stage(), stage]
    repo = export_encoder(tmp_path / "few", tiny_encoder(), TINY, stages, model_name="few")
    assert verify_repo(repo).ok

    def few_terms(ledger: dict) -> dict:
        s = ledger["stages"][1]
        s["mechanism_params"]["rounding_terms"] = 10
        s["sensitivity"] = sensitivity(s["mechanism"], s["clipping_norm"], s["mechanism_params"])
        s["noise_std"] = s["noise_multiplier"] * s["sensitivity"]
        return ledger

    rewrite_ledger_copies(repo, few_terms)
    _fails(repo, "rounding_terms 10 is below", f"sample bound {sample_bound(n, q)}")


def test_a_reference_epsilon_off_its_accountant_fails(tiny_repo):
    def doubled_prv(ledger: dict) -> dict:
        ledger["stages"][1]["reference_epsilon"]["prv"] *= 2
        return ledger

    rewrite_ledger_copies(tiny_repo, doubled_prv)
    text = _fails(tiny_repo, "(prv) is not what that accountant gives")
    assert "claims epsilon" not in text  # the claim (rdp) itself still holds


@pytest.mark.parametrize("sigma", [1e-3, 1e-300])
def test_a_noise_multiplier_too_small_to_account_fails_by_name(tiny_repo, sigma):
    """sigma 1e-3 at q = 1: the PLD grid would take gigabytes (a MemoryError, or minutes on a large
    machine); 1e-300: sigma squared underflows (a ZeroDivisionError). Each is a named problem."""

    def tiny_sigma(ledger: dict) -> dict:
        stage = ledger["stages"][1]
        stage.update(sample_rate=1.0, expected_batch_size=1000.0, noise_multiplier=sigma)
        stage.update(noise_std=sigma * stage["sensitivity"], steps=1000)
        return ledger

    rewrite_ledger_copies(tiny_repo, tiny_sigma)
    _fails(tiny_repo, "stage 'dp-pretraining'", "far too small")


@pytest.mark.parametrize("steps", [10**9, 10**400])
def test_steps_beyond_any_run_are_refused_by_name(tiny_repo, steps):
    """10^9 steps keep the PLD accountant busy for many minutes; 10^400 overflows a float."""

    def many_steps(ledger: dict) -> dict:
        ledger["stages"][1]["steps"] = steps
        return ledger

    rewrite_ledger_copies(tiny_repo, many_steps)
    _fails(tiny_repo, "stages.1.dp.steps: Input should be less than or equal to 10000000")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda s: s["dataset"].update(size=10**400),
            "stages.1.dp.dataset.size: Input should be less than or equal to",
        ),
        (
            lambda s: s.update(noised_dimension=10**400, noised_tensors={"unreleased:t": 10**400}),
            "stages.1.dp.noised_dimension: Input should be less than or equal to",
        ),
        (
            lambda s: s.update(mechanism_params={"rounding_terms": 10**400}),
            "stages.1.dp.mechanism_params: rounding_terms is an integer past",
        ),
        (
            lambda s: s.update(
                mechanism="Logit-DP",
                mechanism_params={
                    "loss": CONTRASTIVE_LOSS,
                    "temperature": 0.1,
                    "max_batch": 10**400,
                },
            ),
            "stages.1.dp.mechanism_params: max_batch is an integer past",
        ),
        (
            lambda s: s.update(
                mechanism="Naive-DP",
                mechanism_params={"loss": CONTRASTIVE_LOSS, "temperature": 10**400},
            ),
            "stages.1.dp.mechanism_params: temperature is an integer past",
        ),
    ],
)
def test_a_ledger_beyond_what_parses_is_refused_by_name(tiny_repo, change, message):
    """A count past a float's range (a mechanism parameter's too: the sensitivity overflowed), or
    lists nested past Python's recursion limit: each a named problem, never an OverflowError or a
    RecursionError."""

    def changed(ledger: dict) -> dict:
        change(ledger["stages"][1])
        return ledger

    rewrite_ledger_copies(tiny_repo, changed)
    _fails(tiny_repo, message)


def test_a_ledger_nested_past_the_recursion_limit_is_refused_by_name(tiny_repo):
    """Past Python's recursion limit json.loads raises RecursionError; at 300 levels pydantic
    parses a ledger it cannot serialise (comparing the copies raised). Each is a named problem."""
    ledger = json.loads((tiny_repo / LEDGER_FILE).read_text())
    ledger["stages"][1]["hyperparameters"]["x"] = json.loads("[" * 300 + "]" * 300)
    for text, message in (
        ("[" * 100_000 + "]" * 100_000, "not valid JSON"),
        ('{"a":' * 100_000 + "1" + "}" * 100_000, "not valid JSON"),
        (json.dumps(ledger), "nests lists and objects deeper than 20 levels"),
    ):
        (tiny_repo / LEDGER_FILE).write_text(text)
        with pytest.raises(LedgerError, match=message):
            PrivacyLedger.parse(text)
        _fails(tiny_repo, f"{LEDGER_FILE}: ledger copy unreadable", message)


@pytest.mark.parametrize("name", ["clf\n", "", "../clf", "a" * 65])
def test_a_head_name_that_is_no_folder_name_is_refused(name):
    """A head's name is its folder's: a final newline ($ matched before it) is refused too."""
    with pytest.raises(ConfigError, match="head name"):
        head_component(name)
    assert head_name_of(HEAD_WEIGHTS_GLOB.replace("*", name)) is None


@pytest.mark.parametrize("name", ["con", "NUL.head", "com1", "probe."])
def test_a_head_name_windows_cannot_write_is_refused_before_training(name):
    """Such a head's folder is a path every commit and ``verify`` refuse: the name passed, and
    the export after the training failed."""
    with pytest.raises(ConfigError, match=f"head name '{re.escape(name)}' (is a Windows|ends)"):
        head_component(name)


def test_a_ledger_of_more_stages_than_verify_recomputes_is_refused_by_name(tiny_repo):
    """Each stage's epsilon is recomputed under every accountant on every upload: past
    MAX_STAGES stages the ledger is refused before any accounting (100 took PRV 40 s)."""

    def many(ledger: dict) -> dict:
        dp = ledger["stages"][1]
        copies = [dp | {"name": f"dp-{i}"} for i in range(MAX_STAGES)]
        ledger["stages"] = ledger["stages"][:1] + copies
        return ledger

    rewrite_ledger_copies(tiny_repo, many)
    _fails(tiny_repo, f"stages: List should have at most {MAX_STAGES} items")


def _audited(canaries: int, counts: int) -> Callable[[dict], dict]:
    """An audit of ``canaries`` canaries recording ``counts`` guess counts (every guess right),
    its canaries counted in the stage's noised tensors and truncation delta."""

    def change(ledger: dict) -> dict:
        stage = ledger["stages"][1]
        every = [(canaries, canaries)] * counts
        add_audit_record(stage, canaries, every, 1.0, 6.0, {"rdp": 1.0, "prv": 1.0, "pld": 1.0})
        restate_truncation(ledger, stage)
        return ledger

    return change


@pytest.mark.parametrize(
    ("canaries", "counts", "message"),
    [
        (10**12, 1, "stages.1.dp.audit.canaries: Input should be less than or equal to 1000000"),
        (1000, 7, "stages.1.dp.audit.results: List should have at most 6 items"),
    ],
)
def test_an_audit_beyond_any_run_is_refused_by_name(tiny_repo, canaries, counts, message):
    """Its ceiling and bound take memory and time in m and in the guess counts: 10^12 canaries
    were a MemoryError (terabytes), a long list of counts hours. Each is a named problem."""
    rewrite_ledger_copies(tiny_repo, _audited(canaries, counts))
    _fails(tiny_repo, f"{LEDGER_FILE}: ledger copy unreadable", message)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"a":' * 100_000 + "1" + "}" * 100_000, "unreadable: maximum recursion depth exceeded"),
        ('{"architecture": "vip-nano", "vip_hub": [1]}', f"{META_ARCH} disagrees with"),
    ],
)
def test_a_malformed_config_is_refused_by_name(tiny_repo, text, message):
    """A RecursionError, and an AttributeError (its vip_hub block a list), were tracebacks."""
    (tiny_repo / CONFIG_FILE).write_text(text)
    _fails(tiny_repo, f"{CONFIG_FILE}: {message}")


def test_a_guarantee_whose_delta_reaches_one_is_refused_by_name(tmp_path):
    """The stored guarantee's delta (0.99) covers the truncation, but the stage's delta plus its
    truncation delta is 1.05: the summary verify prints could not be stated (a ValidationError
    after the checks passed)."""
    stage = DPStage.from_parameters(
        name="dp-pretraining",
        dataset=Dataset(name="test-images", size=1000),
        sample_rate=0.05,
        noise_multiplier=1.0,
        steps=100,
        clipping_norm=0.1,
        noised_tensors={"unreleased:test": 1_000},
        delta=0.3,
    )
    repo = export_encoder(
        tmp_path / "repo", tiny_encoder(), TINY, [synthetic_stage(), stage], model_name="weak"
    )

    def truncation_near_one(ledger: dict) -> dict:
        ledger["stages"][1]["truncation_delta"] = 0.75
        ledger["guarantees"][0].update(delta=0.99, epsilon=1.0)
        return ledger

    rewrite_ledger_copies(repo, truncation_near_one)
    _fails(
        repo,
        f"{LEDGER_FILE}: ledger copy unreadable",
        "delta 0.3 on 'test-images' plus its stages' truncation deltas 0.75 is not below 1",
    )


@pytest.mark.parametrize(
    ("where", "value"),
    [("hyperparameters", float("nan")), ("noise_multiplier", float("inf"))],
)
def test_a_ledger_holding_nan_or_infinity_is_refused_naming_the_field(tiny_repo, where, value):
    """JSON and YAML read NaN and Infinity; NaN made the copies disagree "at top level"."""

    def non_finite(ledger: dict) -> dict:
        stage = ledger["stages"][1]
        if where == "hyperparameters":
            stage["hyperparameters"]["lr"] = value
        else:
            stage[where] = value
        return ledger

    rewrite_ledger_copies(tiny_repo, non_finite)
    field = "lr" if where == "hyperparameters" else ""
    name = f"stages.1.{where}.{field}".rstrip(".")
    text = _fails(
        tiny_repo,
        *[
            f"{copy}: ledger copy unreadable: invalid privacy ledger: {name}: {value} is not"
            for copy in (LEDGER_FILE, WEIGHTS_FILE)
        ],
        # the card's front matter is refused before its ledger is read: JSON has no NaN
        f"{CARD_FILE}: its front matter's {CARD_LEDGER_KEY}."
        + name.replace("stages.1", "stages[1]")
        + " is not a finite number",
    )
    assert "disagrees" not in text


def test_tampered_weights(tiny_repo):
    path = tiny_repo / WEIGHTS_FILE
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    _fails(tiny_repo, f"{WEIGHTS_FILE}: content changed since export")


def _without_a_shape(header: dict) -> bytes:
    del header["mask_token"]["shape"]
    return json.dumps(header).encode()


def _nested_past_the_recursion_limit(header: dict) -> bytes:
    return json.dumps(header).encode()[:-1] + b',"x":' + b"[" * 5000 + b"]" * 5000 + b"}"


@pytest.mark.parametrize(
    "rewrite, message",
    [
        (_without_a_shape, "tensor entry 'mask_token' is malformed"),
        (_nested_past_the_recursion_limit, "header is not JSON"),
    ],
)
def test_a_malformed_weights_header_is_refused_naming_the_file(tiny_repo, rewrite, message):
    """A tensor entry without a shape, or a header nested past Python's recursion limit, is a
    named problem of verify and a VerificationError of load_encoder (a KeyError, a
    RecursionError)."""
    path = tiny_repo / MAE_DECODER_FILE
    header, n = read_safetensors_header(path)
    text = rewrite(header)
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + path.read_bytes()[8 + n :])
    _fails(tiny_repo, f"{MAE_DECODER_FILE}: cannot be digested: {path}: {message}")
    with pytest.raises(VerificationError, match=message):
        load_encoder(tiny_repo)


@pytest.mark.parametrize(
    "change", [lambda c: {**c, "num_heads": 1}, lambda c: {**c, "depth": float(c["depth"])}]
)
def test_a_decoder_whose_configuration_changed_fails_verify(tiny_repo, change):
    """A decoder's configuration lives in its metadata, which the tensors digest leaves out: its
    heads (which no tensor's shape shows) changed fail against the one ``CONFIG_FILE`` binds, and
    so does a count written as a float (``0.0``, which Python's ``==`` takes for ``0``)."""
    path = tiny_repo / MAE_DECODER_FILE
    meta = read_safetensors_metadata(path)
    other = change(json.loads(meta[META_DECODER]))
    rewrite_safetensors_metadata(path, {**meta, META_DECODER: json.dumps(other)})
    _fails(tiny_repo, f"{MAE_DECODER_FILE}: its metadata's configuration is not the one")


def test_tampered_config_and_extra_weights(tiny_repo):
    (tiny_repo / CONFIG_FILE).write_text(
        (tiny_repo / CONFIG_FILE).read_text().replace('"depth": 12', '"depth": 11')
    )
    (tiny_repo / f"extra{WEIGHTS_SUFFIX}").write_bytes((tiny_repo / MAE_DECODER_FILE).read_bytes())
    _fails(tiny_repo, f"{CONFIG_FILE}: content changed", f"extra{WEIGHTS_SUFFIX}: not listed")


def test_missing_files(tiny_repo):
    (tiny_repo / LEDGER_FILE).unlink()
    (tiny_repo / MAE_DECODER_FILE).unlink()
    _fails(tiny_repo, f"{LEDGER_FILE}: missing", f"{MAE_DECODER_FILE}: listed in the ledger")


def test_load_encoder_refuses_unverified(tiny_repo):
    (tiny_repo / LEDGER_FILE).write_text("{}")
    from vip_hub import VerificationError

    with pytest.raises(VerificationError, match=LEDGER_FILE):
        load_encoder(tiny_repo)


def test_weights_replaced_after_verification_are_refused(tiny_repo, monkeypatch):
    """Weights swapped between verify and timm's read (same names, shapes and ledger, other
    values) are refused naming the file; without verification they load as before."""
    swap_after_verify(monkeypatch, tiny_repo / WEIGHTS_FILE)
    with pytest.raises(TamperedFileError, match=f"{WEIGHTS_FILE}: changed after verification"):
        load_encoder(tiny_repo)
    assert load_encoder(tiny_repo, verify=False).spec.arch == "vip-nano"


def test_a_tree_no_filesystem_can_hold_fails_verify(tiny_repo):
    """Two files equal but for case (a clone on macOS or Windows keeps one), or a file that is
    also a folder (a hub commit, verified as a mapping of paths), fail verify by name."""
    from vip_hub.repo.verify import repo_files

    (tiny_repo / "NOTES.md").write_text("a\n")
    (tiny_repo / "notes.md").write_text("b\n")
    _fails(tiny_repo, "'NOTES.md' and 'notes.md' differ only by case")
    files = {**repo_files(tiny_repo), "notes.md/x.md": tiny_repo / "notes.md"}
    problems = "; ".join(map(str, verify_repo(files).problems))
    assert "'notes.md' is a file and the folder of 'notes.md/x.md'" in problems, problems


def test_loaded_tensors_are_bound_by_their_files_digest_alone(tiny_repo):
    """``check_loaded_tensors`` holds tensors read after verify to the verified ledger's digest of
    the file they were read as: the weights pass as their own file, and the same tensors read as a
    file the ledger does not list (so no digest binds them) are refused."""
    from vip_hub.repo.verify import check_loaded_tensors

    ledger, path = PrivacyLedger.read(tiny_repo), tiny_repo / WEIGHTS_FILE
    check_loaded_tensors(ledger, WEIGHTS_FILE, path, load_file(path))
    with pytest.raises(TamperedFileError, match="notes/extra.safetensors: changed after"):
        check_loaded_tensors(ledger, "notes/extra.safetensors", path, load_file(path))


def _other_normalisation(repo: Path) -> None:
    """Rewrite ``repo``'s ``CONFIG_FILE`` with another input normalisation (still valid)."""
    config = json.loads((repo / CONFIG_FILE).read_bytes())
    config["pretrained_cfg"]["mean"] = [0.5, 0.5, 0.5]
    (repo / CONFIG_FILE).write_text(json.dumps(config))


def test_a_config_replaced_after_verification_is_refused_or_never_read(tiny_repo, monkeypatch):
    """``CONFIG_FILE`` swapped between verify and the load (another normalisation, valid JSON) is
    refused naming the file; swapped once its verified bytes were read, timm still builds the
    model from the verified bytes."""
    import vip_hub.loading as loading

    verified_mean = load_encoder(tiny_repo).model.pretrained_cfg["mean"]
    real_verify, real_create = loading.verify_repo, timm.create_model

    def verify_then_swap(*args, **kwargs):
        report = real_verify(*args, **kwargs)
        _other_normalisation(tiny_repo)
        return report

    original = (tiny_repo / CONFIG_FILE).read_bytes()
    monkeypatch.setattr(loading, "verify_repo", verify_then_swap)
    with pytest.raises(TamperedFileError, match=f"{CONFIG_FILE}: changed after verification"):
        load_encoder(tiny_repo)
    (tiny_repo / CONFIG_FILE).write_bytes(original)
    monkeypatch.setattr(loading, "verify_repo", real_verify)

    def swap_then_create(*args, **kwargs):
        _other_normalisation(tiny_repo)
        return real_create(*args, **kwargs)

    monkeypatch.setattr(timm, "create_model", swap_then_create)
    encoder = load_encoder(tiny_repo)
    assert list(encoder.model.pretrained_cfg["mean"]) == list(verified_mean) != [0.5, 0.5, 0.5]
    assert encoder.config["pretrained_cfg"]["mean"] == list(verified_mean)


def test_float16_weights_load_verified_and_a_finer_swap_is_refused(
    tmp_path, dp_stage_session, monkeypatch
):
    """float16 weights load into the float32 model and check against their digest; float32
    weights that round to the same float16 values are not the verified ones."""
    repo = export_encoder(
        tmp_path / "half", tiny_encoder(), TINY, [dp_stage_session], model_name="half",
        weights_dtype=torch.float16,
    )  # fmt: skip
    assert load_encoder(repo).model.pos_embed.dtype == torch.float32
    swap_after_verify(monkeypatch, repo / WEIGHTS_FILE, lambda t: t.float() * (1 + 2**-14))
    original, create = (repo / WEIGHTS_FILE).read_bytes(), timm.create_model

    def create_then_swap_back(*args, **kwargs):  # the check reads the verified file's header
        model = create(*args, **kwargs)
        (repo / WEIGHTS_FILE).write_bytes(original)
        return model

    monkeypatch.setattr(timm, "create_model", create_then_swap_back)
    with pytest.raises(TamperedFileError, match=f"{WEIGHTS_FILE}: changed after verification"):
        load_encoder(repo)


def test_update_repo_adds_stage_file_and_result(tiny_repo):
    before = (tiny_repo / WEIGHTS_FILE).read_bytes()
    stage = NonPrivateStage(
        name="linear-probe",
        component=head_component("probe"),
        dataset=Dataset(name="labels", size=10),
        private_data=True,
    )
    result = EvalResult(
        task_type="image-classification",
        dataset_type="labels",
        dataset_name="labels",
        metric_type="accuracy",
        metric_value=0.5,
        metric_name="linear probe (vip)",
    )
    ledger = update_repo(
        tiny_repo,
        add_stages=[stage],
        add_files={head_file("probe", HEAD_LABELS): b"[]"},
        add_eval_results=[result],
    )
    assert ledger.stage("linear-probe").component == head_component("probe")
    assert head_file("probe", HEAD_LABELS) in ledger.artifacts
    assert verify_repo(tiny_repo).ok
    card = ModelCard.load(tiny_repo / CARD_FILE)
    assert card.data.eval_results[0].metric_value == 0.5
    assert "No guarantee covers" in card.text
    assert (tiny_repo / WEIGHTS_FILE).read_bytes() != before  # metadata rewritten
    with pytest.raises(ValueError, match="managed by vip_hub"):
        update_repo(tiny_repo, add_files={CONFIG_FILE: b"{}"})


def test_update_refuses_broken_repo_and_leaves_it_alone(tiny_repo):
    (tiny_repo / CONFIG_FILE).write_text("{}")
    snapshot = {p.name: p.read_bytes() for p in tiny_repo.iterdir()}
    from vip_hub import VerificationError

    with pytest.raises(VerificationError):
        update_repo(tiny_repo, add_files={"x.txt": b"x"})
    assert {p.name: p.read_bytes() for p in tiny_repo.iterdir()} == snapshot


class _Killed(BaseException):
    """A kill (SIGKILL, power loss) at a chosen point of a write."""


@pytest.mark.parametrize("write", ["update", "export"])
def test_a_write_killed_after_any_rename_leaves_the_old_repo_or_the_new_one(
    tiny_repo, monkeypatch, write
):
    """An update or an export over an earlier repo, killed just after any rename it makes: the
    repo's path holds the old repo or the new one, whole and verified, never nothing (the old one
    renamed aside, the new one not yet in its place: the release lost)."""
    import os

    before = PrivacyLedger.read(tiny_repo).to_json()
    rename = os.rename

    def rename_then_die(*args, **kwargs):
        rename(*args, **kwargs)
        raise _Killed

    monkeypatch.setattr(os, "rename", rename_then_die)
    with contextlib.suppress(_Killed):
        if write == "update":
            update_repo(tiny_repo, add_files={"notes.txt": b"new"})
        else:
            export_encoder(
                tiny_repo, tiny_encoder(), TINY, [synthetic_stage()], model_name="x", overwrite=True
            )
    monkeypatch.undo()
    assert verify_repo(tiny_repo).ok
    assert PrivacyLedger.read(tiny_repo).to_json() != before  # the write was whole: the new one


def test_heads_round_trip_and_replace(tiny_repo):
    from vip_hub.repo.heads import HeadInfo, LinearProbe, list_heads, load_head, save_head

    torch.manual_seed(0)
    head = LinearProbe(1152, 3)
    head.norm.running_mean.normal_()
    stage = NonPrivateStage(
        name="linear-probe:toy",
        component=head_component("toy"),
        dataset=Dataset(name="toy-labels", size=30),
        private_data=True,
    )
    save_head(tiny_repo, head, HeadInfo("toy", "vip", ["a", "b", "c"], {"top1": 0.9}), stage)
    assert list_heads(tiny_repo) == ["toy"]
    loaded, info = load_head(tiny_repo, "toy")
    assert info.labels == ["a", "b", "c"] and info.pooling == "vip"
    assert info.metrics == {"top1": 0.9, METRICS_POOLING: "vip"}  # the mode bound by a digest
    x = torch.randn(5, 1152)
    head.eval()
    torch.testing.assert_close(loaded(x), head(x))
    # saving again under the same name replaces the stage and files, not duplicates them
    avg = LinearProbe(192, 3).eval()  # the avg features' width
    ledger = save_head(tiny_repo, avg, HeadInfo("toy", "avg", ["a", "b", "c"]), stage)
    assert [s.name for s in ledger.stages].count("linear-probe:toy") == 1
    assert load_head(tiny_repo, "toy")[1].pooling == "avg"
    assert verify_repo(tiny_repo).ok
    with pytest.raises(ValueError, match=f"component '{head_component('other')}'"):
        save_head(tiny_repo, head, HeadInfo("other", "vip", ["a", "b", "c"]), stage)
    with pytest.raises(ValueError, match="head name"):
        save_head(tiny_repo, head, HeadInfo("../x", "vip", ["a", "b", "c"]), stage)


@pytest.mark.parametrize(
    "meta, message",
    [
        ({META_LABELS: '["blue", "green", "red"]'}, "its metadata's labels are not"),
        ({META_LABELS: '["red", "green"]'}, "its metadata's labels are not"),
        ({META_IN_FEATURES: "192"}, "linear.weight has shape [3, 1152], not 3 labels by 192"),
        ({META_POOLING: "avg"}, "its metadata's feature mode 'avg' is not"),
    ],
)
def test_a_head_whose_metadata_disagrees_with_its_files_fails_verify(tmp_path, meta, message):
    """The tensors digest leaves a head's metadata out, and the loader reads the head from it:
    swapped labels (classify answered 'blue' for what ``HEAD_LABELS`` calls 'red'), a labels
    count or width its weights do not have, a feature mode of another width verified and loaded."""
    repo = tiny_repo_with_head(tmp_path / "repo")
    path = repo / head_file("toy")
    rewrite_safetensors_metadata(path, {**read_safetensors_metadata(path), **meta})
    _fails(repo, f"{head_file('toy')}: {message}")
    with pytest.raises(TamperedFileError, match=re.escape(message)):
        load_encoder(repo)


def test_a_head_read_through_another_mode_of_its_width_is_refused(tiny_repo, monkeypatch):
    """The tensors digest leaves a head's feature mode out and ``avg`` and ``cls`` have one width:
    a head relabelled from one to the other would classify other features with the same weights.
    Its metrics file (digested) binds the mode, for ``verify`` and for a load after it; a head
    saved for a mode of another width fails by that width."""
    from vip_hub.repo.heads import HeadInfo, LinearProbe, load_head, save_head

    def stage_of(name: str) -> NonPrivateStage:
        return NonPrivateStage(
            name=f"linear-probe:{name}",
            component=head_component(name),
            dataset=Dataset(name="toy-labels", size=30),
            private_data=True,
        )

    stage = stage_of("toy")
    save_head(tiny_repo, LinearProbe(192, 3).eval(), HeadInfo("toy", "avg", ["a", "b", "c"]), stage)
    ledger = load_encoder(tiny_repo).ledger
    assert load_head(tiny_repo, "toy", ledger)[1].pooling == "avg"
    path = tiny_repo / head_file("toy")
    original = path.read_bytes()
    rewrite_safetensors_metadata(path, {**read_safetensors_metadata(path), META_POOLING: "cls"})
    with pytest.raises(TamperedFileError, match="its feature mode is not"):
        load_head(tiny_repo, "toy", ledger)  # changed after the repo verified
    message = f"its metadata's feature mode 'cls' is not {head_file('toy', HEAD_METRICS)}'s ('avg')"
    _fails(tiny_repo, f"{head_file('toy')}: {message}")
    path.write_bytes(original)
    # the update itself refuses such a head: let it write one, for verify to find
    staged_reports(monkeypatch)
    save_head(tiny_repo, LinearProbe(192, 3), HeadInfo("wide", "vip", ["a"] * 3), stage_of("wide"))
    _fails(tiny_repo, f"reads 192 features of mode 'vip', which {CONFIG_FILE}'s feature_dims")
    with pytest.raises(ConfigError, match="another feature mode"):
        save_head(
            tiny_repo,
            LinearProbe(192, 3),
            HeadInfo("toy", "cls", ["a"] * 3, {METRICS_POOLING: "avg"}),
            stage,
        )


def test_a_head_replaced_after_verification_is_refused(tmp_path, monkeypatch):
    """A head's weights read after the repo verified (as the inference service loads them) must
    be the ones the verified ledger binds: a head file swapped in between is refused naming it."""
    from vip_hub.repo.heads import load_head

    repo = tiny_repo_with_head(tmp_path / "repo")
    ledger = load_encoder(repo).ledger
    assert load_head(repo, "toy", ledger)[1].labels == ["red", "green", "blue"]
    path = repo / head_file("toy")
    original = path.read_bytes()
    swap_after_verify(monkeypatch, repo / head_file("toy"))
    load_encoder(repo)  # the swap happens here, after the repo verified
    with pytest.raises(TamperedFileError, match=f"{head_file('toy')}: changed after verification"):
        load_head(repo, "toy", ledger)
    path.write_bytes(original)  # now its labels, which the tensors' digest leaves out
    rewrite_safetensors_metadata(
        path, {**read_safetensors_metadata(path), META_LABELS: '["blue", "green", "red"]'}
    )
    with pytest.raises(TamperedFileError, match=f"{head_file('toy')}: changed after verification"):
        load_head(repo, "toy", ledger)


def test_verify_recomputes_the_truncation_delta(tiny_repo):
    """Issue 32: a stage that records a sampler truncated at 5.768 sigma but not the delta it
    adds is an overclaim."""

    def truncated_early(ledger: dict) -> dict:
        ledger["stages"][1]["noise_support"] = 5.768
        return ledger

    rewrite_ledger_copies(tiny_repo, truncated_early)
    _fails(tiny_repo, "records a truncation delta of", "noise truncated at 5.768 sigma")


@pytest.mark.parametrize("support", [1000.0, 9.0, 12.0, 5.768])
def test_verify_refuses_a_noise_support_no_known_sampler_has(tiny_repo, support):
    """Issue 54, point 4: a stage that claims c = 1000 (its truncation delta recomputed, so every
    other check passes) names no sampler vip-hub knows, nor does a c between or near the known
    ones (torch's CPU float32 Box-Muller, 5.768, was never recorded in a v4 ledger)."""

    def forged(ledger: dict) -> dict:
        stage = ledger["stages"][1]
        stage["noise_support"] = support
        stage["truncation_delta"] = truncation_delta(
            stage["noise_multiplier"],
            stage["sample_rate"],
            stage["steps"],
            support,
            stage["noised_dimension"],
        )
        return ledger

    rewrite_ledger_copies(tiny_repo, forged)
    text = _fails(tiny_repo, f"records noise support c = {support:g} sigma", "no noise sampler")
    assert "records a truncation delta" not in text  # the forgery's only flaw


def test_verify_names_a_vanishing_noise_support_without_recomputing_its_truncation(tiny_repo):
    """A support of 1e-200 sigma made the truncation delta's logarithm fail with a traceback."""
    rewrite_ledger_copies(tiny_repo, lambda d: d["stages"][1].update(noise_support=1e-200) or d)
    _fails(tiny_repo, "records noise support c = 1e-200 sigma", "no noise sampler")


LOGIT_DP_PARAMS = {"loss": CONTRASTIVE_LOSS, "temperature": 0.1, "max_batch": 100}


@pytest.mark.parametrize(
    ("params", "recorded", "refusal"),
    [
        (  # the noise is 1 sensitivity, not the sigma of 10 its epsilon (0.19) is computed at
            {},
            {"clipping_norm": 1e308, "sensitivity": 1e308},
            "noise std 1e+308 is not sigma * sensitivity = inf",
        ),
        (
            {"mechanism": "Logit-DP", "sensitivity": 1e307, "mechanism_params": LOGIT_DP_PARAMS},
            {},
            "claims sensitivity 1e+307 but Logit-DP",
        ),
    ],
)
def test_verify_refuses_a_stage_whose_recomputed_noise_or_sensitivity_overflows(
    tiny_repo, params, recorded, refusal
):
    """sigma * Delta (or Logit-DP's sensitivity) past the largest float is inf, and a claim
    compared with it by a tolerance compared with NaN and passed."""
    stage = DPStage.from_parameters(
        name="dp-pretraining",
        dataset=Dataset(name="test-images", size=1000),
        sample_rate=0.05,
        noise_multiplier=10.0 if not params else 1.0,
        steps=100,
        clipping_norm=1e307,
        noised_tensors={"unreleased:test": 1_000},
        **params,
    )

    def overflowing(ledger: dict) -> dict:
        dumped = {**stage.model_dump(mode="json", by_alias=True), **recorded}
        ledger["stages"][1] = dumped
        ledger["guarantees"][0].update(
            epsilon=dumped["epsilon"], delta=dumped["delta"] + dumped["truncation_delta"]
        )
        return ledger

    rewrite_ledger_copies(tiny_repo, overflowing)
    _fails(tiny_repo, refusal)


def test_verify_names_a_noised_tensor_that_is_the_weights_metadata(tiny_repo):
    """The header's ``__metadata__`` entry is no tensor: with a forged "shape" in the metadata
    (outside the digest) it crashed verify, or counted as one element."""
    path = tiny_repo / WEIGHTS_FILE

    def metadata_counted(ledger: dict) -> dict:
        counted = ledger["stages"][1]["noised_tensors"]
        counted["unreleased:test"] -= 1  # the dimension unchanged
        counted[f"{WEIGHTS_FILE}:__metadata__"] = 1
        return ledger

    rewrite_ledger_copies(tiny_repo, metadata_counted)
    rewrite_safetensors_metadata(path, {**read_safetensors_metadata(path), "shape": "[1]"})
    _fails(tiny_repo, f"counts the noised tensor {WEIGHTS_FILE}:__metadata__, which")


def test_a_broken_weights_header_is_named_under_the_weights_not_the_config(tiny_repo):
    """The configuration check read the header too, and named the configuration for its fault."""
    path = tiny_repo / WEIGHTS_FILE
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + size])
    header[next(k for k in header if k != "__metadata__")]["dtype"] = "XX"
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + size :])
    report = verify_repo(tiny_repo)
    assert not report.ok and all(p.where != CONFIG_FILE for p in report.problems), report.problems
    assert any(p.where == WEIGHTS_FILE for p in report.problems)


@pytest.mark.parametrize("field", ["noise_std", "epsilon", "expected_batch_size"])
def test_a_ledger_spelling_infinity_as_a_string_is_refused_naming_the_field(tiny_repo, field):
    """pydantic read "inf" where a number goes: the copies verified with C = inf, or an
    epsilon of inf crashed the card's headline. A ledger is now read strictly: a string is no
    number."""
    rewrite_ledger_copies(tiny_repo, lambda d: d["stages"][1].update({field: "inf"}) or d)
    text = _fails(tiny_repo, f"stages.1.dp.{field}: Input should be a valid number")
    assert "Traceback" not in text


@pytest.mark.parametrize("sampler", sorted(NOISE_SAMPLERS))
def test_verify_accepts_every_known_noise_sampler(tiny_repo, sampler):
    """The shipped sampler, the ziggurat of releases before it and the imports' curand sampler."""

    def recorded(ledger: dict) -> dict:
        stage = ledger["stages"][1]
        stage["noise_support"] = NOISE_SAMPLERS[sampler]
        stage["truncation_delta"] = truncation_delta(
            stage["noise_multiplier"],
            stage["sample_rate"],
            stage["steps"],
            NOISE_SAMPLERS[sampler],
            stage["noised_dimension"],
        )
        ledger["guarantees"][0]["delta"] = stage["delta"] + stage["truncation_delta"]
        return ledger

    rewrite_ledger_copies(tiny_repo, recorded)
    report = verify_repo(tiny_repo)
    assert report.ok, report.problems


@pytest.mark.parametrize("field", ["truncation_delta", "noise_support", "noised_dimension"])
def test_verify_refuses_a_ledger_without_the_truncation_bound(tiny_repo, field):
    def omitted(ledger: dict) -> dict:
        del ledger["stages"][1][field]
        return ledger

    rewrite_ledger_copies(tiny_repo, omitted)
    _fails(tiny_repo, field)


def _card_of(repo: Path) -> tuple[dict, str]:
    """A repo card's front matter and its text, one space between words."""
    card = ModelCard.load(repo / CARD_FILE)
    return card.data.to_dict(), " ".join(card.text.split())


def test_a_cards_recipe_line_and_tags_follow_its_stages_not_its_family(tmp_path, tiny_repo):
    """A ViP-family encoder distilled without DP (what the committed priors are) is not carded as
    MAE with DP-AdamW; a DP stage's card names its mechanism, and what its guarantee assumes."""
    distilled = NonPrivateStage(
        name="syn-scatter",
        dataset=Dataset(name="vip-hub-procedural-v1"),
        private_data=False,
        description="ScatterNet distillation on procedural images",
    )
    prior = export_encoder(tmp_path / "prior", tiny_encoder(), TINY, [distilled], model_name="p")
    data, text = _card_of(prior)
    recipe = text.split("| Recipe |")[1].split("|")[0]
    assert "syn-scatter (no DP, on vip-hub-procedural-v1: no private data)" in recipe, recipe
    assert "MAE" not in recipe and "DP-AdamW" not in recipe
    assert "mae" not in data["tags"] and "differential-privacy" not in data["tags"]
    assert "no-private-data" in data["tags"]
    assert "| Guarantee assumes | nothing of the arithmetic: no DP stage" in text

    data, text = _card_of(tiny_repo)  # a synthetic stage, then a DP-AdamW stage
    recipe = text.split("| Recipe |")[1].split("|")[0]
    assert recipe.strip() == (
        "synthetic-pretraining (no DP, on procedural-images: no private data), then "
        "dp-pretraining (DP-AdamW on test-images)"
    )
    assert {"differential-privacy", "dp-adamw"} <= set(data["tags"])
    assert "no-private-data" not in data["tags"]


def test_every_dp_card_says_what_its_guarantee_assumes_of_floating_point(tmp_path, monkeypatch):
    """One line: the noise's float64 draw rounded once is a mitigation, not a proof; a stage
    whose clipped sum records a proved rule rests on per-example gradients independent of their
    batch, one that records none (or fp32-blocked) on a model of blocked fp32 summation."""
    proved = dp_stage().model_copy(
        update={"name": "dp-proved", "mechanism_params": rounding_params(1000, 0.05)}
    )
    # its sensitivity is not recomputed for those params (verify would refuse): only its card here
    staged_reports(monkeypatch)
    repo = export_encoder(
        tmp_path / "r", tiny_encoder(), TINY, [dp_stage(), proved], model_name="r"
    )
    _, text = _card_of(repo)
    (line,) = [x.split("|")[0] for x in text.split("| Guarantee assumes |")[1:]]
    assert (
        "drawn in float64 and rounded once (a mitigation of floating-point leakage, not a proof)"
    ) in line
    assert (
        "dp-proved: each clipped sum within its rounding allowance, proved given that an "
        "example's gradient does not depend on the rest of its batch"
    ) in line
    assert (
        "dp-pretraining: each clipped sum within its rounding allowance under a model of "
        "blocked fp32 summation, not a proof"
    ) in line


def test_a_cards_comparison_says_whether_the_dataset_page_composes_it(tiny_repo):
    """Rows released in a repo of the hub are composed on the dataset's page, and the card says
    so; a row that names no repo (a figure in no ledger) is called out, never said composed."""
    row = {"model": "m", "privacy": "p", "features": "f", "top1": 0.5}
    update_repo(tiny_repo, comparison=[{**row, "repo": "vip/a"}])
    _, text = _card_of(tiny_repo)
    assert "the hub's page for that dataset composes them all" in text
    assert "in no ledger" not in text and "| vip/a |" in text
    update_repo(tiny_repo, comparison=[{**row, "repo": "vip/a"}, row])
    _, text = _card_of(tiny_repo)
    assert "Rows that name no repo are in no ledger of this hub" in text
    assert "composes them all" not in text and "| no repo: in no ledger |" in text


def test_a_cards_comparison_row_shows_its_head_draws_and_a_bad_draw_leaves_the_row_out(tiny_repo):
    """A row whose head was drawn several times shows every draw's top-1 beside its own and the
    card says what they are; a row whose draws are not numbers is not rendered."""
    row = {"model": "m", "repo": "vip/a", "privacy": "p", "features": "f", "top1": 0.5}
    update_repo(tiny_repo, comparison=[{**row, "draws": [0.5, 0.4875, 0.51]}])
    _, text = _card_of(tiny_repo)
    assert "| f | 0.5000 (draws 0.5000, 0.4875, 0.5100) |" in text
    assert "every draw's top-1 is in brackets" in text
    update_repo(tiny_repo, comparison=[row, {**row, "model": "n", "draws": ["x"]}])
    _, text = _card_of(tiny_repo)
    assert "| m | vip/a |" in text and "| n |" not in text


def _named_repo(folder: Path) -> Path:
    """A tiny repo whose DP stage names what its noise went to: block 11 of the released encoder
    (in ``WEIGHTS_FILE``) and a projection head it does not release."""
    encoder = tiny_encoder()
    trained = {
        noised_key(WEIGHTS_FILE, name): p.numel()
        for name, p in encoder.named_parameters()
        if name.startswith("blocks.11.")
    }
    plain = dp_stage()
    stage = DPStage.from_parameters(
        name=plain.name,
        dataset=plain.dataset,
        sample_rate=plain.sample_rate,
        noise_multiplier=plain.noise_multiplier,
        steps=plain.steps,
        clipping_norm=plain.clipping_norm,
        noised_tensors={**trained, noised_key(NOT_RELEASED, "projection.weight"): 4096},
    )
    return export_encoder(folder, encoder, TINY, [stage], model_name=folder.name)


def _d_forged(change: Callable[[dict], None]) -> Callable[[dict], dict]:
    """A ledger rewrite: ``change`` on the DP stage, its truncation delta (and the guarantee's
    delta) recomputed from the new d, so that d is the forgery's only flaw."""

    def forged(ledger: dict) -> dict:
        stage = ledger["stages"][0]
        change(stage)
        restate_truncation(ledger, stage)
        return ledger

    return forged


def _d_is_one(stage: dict) -> None:
    stage["noised_dimension"] = 1


def _d_without_its_tensors(stage: dict) -> None:
    del stage["noised_tensors"]
    stage["noised_dimension"] = 1


FC1 = "blocks.11.mlp.fc1.weight"


def _a_released_tensor_shrunk(stage: dict) -> None:
    stage["noised_tensors"][noised_key(WEIGHTS_FILE, FC1)] = 1
    stage["noised_dimension"] = sum(stage["noised_tensors"].values())


def _a_released_tensor_renamed(stage: dict) -> None:
    count = stage["noised_tensors"].pop(noised_key(WEIGHTS_FILE, FC1))
    stage["noised_tensors"][noised_key(WEIGHTS_FILE, "blocks.11.mlp.fc9.weight")] = count


@pytest.mark.parametrize(
    ("forgery", "message"),
    [
        (_d_is_one, "noised_dimension 1 is not the"),
        (_d_without_its_tensors, "records a noised dimension of 1 without the tensors it counts"),
        (_a_released_tensor_shrunk, f"counts 1 noised elements in {noised_key(WEIGHTS_FILE, FC1)}"),
        (_a_released_tensor_renamed, f"blocks.11.mlp.fc9.weight, which {WEIGHTS_FILE} lacks"),
    ],
)
def test_verify_checks_the_noised_dimension_against_the_released_tensors(
    tmp_path, forgery, message
):
    """Issue 54, point 4: d is what the stage's named tensors and canaries count, each tensor a
    weights file of the repo holds has that many elements; a re-exported repo whose stage claims
    d = 1 (its truncation delta recomputed, every copy consistent) does not verify."""
    repo = _named_repo(tmp_path / "named")
    report = verify_repo(repo)
    assert report.ok, report.problems
    (stage,) = report.ledger.dp_stages()
    assert stage.noised_dimension == 4096 + sum(
        p.numel() for n, p in tiny_encoder().named_parameters() if n.startswith("blocks.11.")
    )
    rewrite_ledger_copies(repo, _d_forged(forgery))
    text = _fails(repo, message)
    assert "records a truncation delta of" not in text  # the forgery's only flaw is d


def test_a_card_written_before_delta_was_rounded_up_still_verifies(tiny_repo):
    """Cards written before 2026-12-03 state δ to the nearest (the headline at two significant
    digits) and ε rounded up from its binary value: their repos still verify, and take commits,
    though new cards state δ rounded up; a statement in neither rendering is still refused."""
    card = tiny_repo / CARD_FILE
    ledger = PrivacyLedger.parse((tiny_repo / LEDGER_FILE).read_text())
    now = card_statements(ledger)
    with rounding_before_2026_12_03():
        then = card_statements(ledger)
    changed = [(a, b) for a, b in zip(now, then, strict=True) if a != b]
    assert changed and "δ = 1e-05)-DP" in then[0] and "δ = 1.01e-05)-DP" in now[0], changed
    text = card.read_text()
    for a, b in changed:
        text = text.replace(a, b)
    card.write_text(text)
    assert verify_repo(tiny_repo).ok, verify_repo(tiny_repo).problems
    card.write_text(text.replace(then[0], then[0].replace("δ = 1e-05", "δ = 9e-06")))
    _fails(tiny_repo, "its text does not state")


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_encoder_shapes_are_the_tensors_timm_builds(arch):
    """``encoder_shapes``, what verify holds a repo's weights to without timm (a hub verifies
    without it), is the state dict timm builds for the spec, at every size, depth and grid."""
    for spec in (EncoderSpec(arch), EncoderSpec(arch, img_size=48, patch_size=8, depth=2)):
        with torch.device("meta"):
            built = create_encoder(spec).state_dict()
        assert encoder_shapes(spec) == {k: tuple(v.shape) for k, v in built.items()}


def _renamed(tensors: dict[str, torch.Tensor]) -> None:
    tensors["zzz_extra"] = tensors.pop("fc_norm.bias")


def _reshaped(tensors: dict[str, torch.Tensor]) -> None:
    tensors["fc_norm.weight"] = tensors["fc_norm.weight"].reshape(1, -1).contiguous()


@pytest.mark.parametrize(
    "change, named",
    [
        (_renamed, "missing: fc_norm.bias; unexpected: zzz_extra"),
        (_reshaped, "wrong shape: fc_norm.weight [1, 192] (expected [192])"),
    ],
)
def test_weights_that_are_not_the_configured_model_are_refused_by_name(tiny_repo, change, named):
    """Weights of the configured parameter count whose tensors timm's model does not hold (their
    digest rewritten into the ledger) verified, and load_encoder raised torch's RuntimeError."""
    path = tiny_repo / WEIGHTS_FILE
    meta, tensors = read_safetensors_metadata(path), load_file(path)
    change(tensors)
    save_file(tensors, path, metadata=meta)
    _redigest(tiny_repo, WEIGHTS_FILE)
    _fails(tiny_repo, f"{WEIGHTS_FILE}: its tensors are not those of the vip-nano", named)
    with pytest.raises(VerificationError, match=re.escape(named)):
        load_encoder(tiny_repo)
    with pytest.raises(RepoFormatError, match=f"{WEIGHTS_FILE}: not the tensors of the model"):
        load_encoder(tiny_repo, verify=False)


@pytest.mark.parametrize(
    "name, clash",
    [
        (
            CONFIG_FILE.capitalize(),
            f"'{CONFIG_FILE.capitalize()}' and '{CONFIG_FILE}' differ only by case",
        ),
        (MAE_DECODER_FILE.upper(), f"and '{MAE_DECODER_FILE}' differ only by case"),
        # signed later
        (
            SIGNATURE_FILE.capitalize(),
            f"'{SIGNATURE_FILE.capitalize()}' and '{SIGNATURE_FILE}' differ only by case",
        ),
        (f"{CONFIG_FILE}/notes.txt", f"'{CONFIG_FILE}' is a file and the folder of"),
    ],
)
def test_update_refuses_a_file_the_repos_own_files_leave_no_room_for(tiny_repo, name, clash):
    """A name equal to one of the repo's files but for case, or below one, was written: the repo
    then failed verify (its signature dropped), or the update crashed with FileExistsError."""
    before = {p.name: p.read_bytes() for p in tiny_repo.iterdir()}
    with pytest.raises(UnsafePathError, match=re.escape(clash)):
        update_repo(tiny_repo, add_files={name: b"notes\n"})
    assert {p.name: p.read_bytes() for p in tiny_repo.iterdir()} == before
    assert verify_repo(tiny_repo).ok


@pytest.mark.parametrize(
    "name, clash",
    [
        (CARD_FILE.upper(), f"'{CARD_FILE.upper()}' and '{CARD_FILE}' differ only by case"),
        (f"{WEIGHTS_FILE}/notes.txt", f"'{WEIGHTS_FILE}' is a file and the folder of"),
        (".notes.txt", ".notes.txt: a hidden file, which verify and signatures skip"),
        (".cache/notes.txt", ".cache/notes.txt: a hidden file"),
        ("notes.bin", "notes.bin: a '.bin' file is refused by name"),  # by the staged verify
    ],
)
def test_export_refuses_an_extra_file_it_could_not_release(tmp_path, name, clash):
    """Names its own files leave no room for, names verify skips, kinds verify refuses."""
    out = tmp_path / "out"
    with pytest.raises(VipHubError, match=re.escape(clash)):
        export_encoder(
            out,
            tiny_encoder(),
            TINY,
            [synthetic_stage()],
            model_name="x",
            extra_files={name: b"x\n"},
        )
    assert not out.exists()
