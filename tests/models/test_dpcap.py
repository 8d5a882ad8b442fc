"""DP-Cap: import of a checkpoint in the reference layout (built here: nothing can be downloaded),
token-level parity with an independent implementation of the reference forward pass, feature
modes, captions and zero-shot, the preset ledger and the card.

The reference implementation, ``ReferenceDPCap``, is ``tests/support/dpcap.py``'s."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil

import pytest
import timm
import torch
import torch.nn.functional as F
from support.dpcap import (
    ARCH,
    IMG,
    TEXT_LEN,
    VOCAB,
    WIDTH,
    ReferenceDPCap,
    import_reference,
    save_reference,
    write_vocab,
)
from support.helpers import swap_after_verify, synthetic_stage, tiny_encoder
from torch import nn

from vip_hub import load_encoder, verify_repo
from vip_hub.cli.main import main
from vip_hub.errors import CheckpointError, ConfigError, MissingInputError, TamperedFileError
from vip_hub.loading import CaptioningModel, load_captioner
from vip_hub.models.encoders import EncoderSpec, create_encoder
from vip_hub.models.text_decoder import Captioner, TextDecoder, TextDecoderConfig, caption_loss
from vip_hub.models.tokenizer import CaptionTokenizer
from vip_hub.repo.artifacts import read_safetensors_metadata, rewrite_safetensors_metadata
from vip_hub.repo.files import export_encoder, load_text_decoder
from vip_hub.repo.importer import PRESETS, import_dpcap_checkpoint
from vip_hub.repo_format import (
    CARD_FILE,
    CONFIG_BLOCK,
    CONFIG_FILE,
    LEDGER_FILE,
    META_DECODER,
    TEXT_DECODER_FILE,
    VOCAB_FILE,
    WEIGHTS_FILE,
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    torch.manual_seed(0)
    ref = ReferenceDPCap().eval()
    return ref, save_reference(ref, tmp_path_factory.mktemp("ckpt") / "checkpoint-4.pth")


@pytest.fixture(scope="module")
def repo(reference, tmp_path_factory):
    return import_reference(reference[1], tmp_path_factory.mktemp("dpcap"))


def images(n=3, seed=1):
    return torch.randn(n, 3, IMG, IMG, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------ parity
def test_encoder_tokens_match_the_reference_with_plain_timm(reference, repo):
    ref, _ = reference
    model = timm.create_model(f"local-dir:{repo}", pretrained=True).eval()
    cfg = json.loads((repo / CONFIG_FILE).read_text())
    assert cfg["model_args"]["qkv_bias"] is False and cfg["model_args"]["num_heads"] == 6
    modes = list(cfg[CONFIG_BLOCK]["feature_dims"])
    assert cfg[CONFIG_BLOCK]["family"] == "dpcap" and modes[:3] == ["dpcap", "avg", "cls"]
    assert modes[3:] and all(m.startswith("spatial-") for m in modes[3:])  # the default ones
    x = images()
    with torch.no_grad():
        want = ref.forward_encoder(x)
        got = model.forward_features(x)
        default = model(x)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(
        default, want[:, 1:].mean(1), atol=2e-5, rtol=1e-5
    )  # timm's forward: avg


def test_feature_modes_match_the_reference_and_others_are_refused(reference, repo):
    ref, _ = reference
    enc = load_encoder(repo)
    x = images()
    with torch.no_grad():
        tokens = ref.forward_encoder(x)
        want = {
            "dpcap": ref.linear_prob_forward(x).mean(1),
            "avg": tokens[:, 1:].mean(1),
            "cls": tokens[:, 0],
        }
    assert enc.poolings[:3] == ("dpcap", "avg", "cls")
    for mode, value in want.items():
        torch.testing.assert_close(enc.embed(x, mode), value, atol=2e-5, rtol=1e-5)
        assert enc.feature_dim(mode) == value.shape[1]
    assert enc.feature_dim("dpcap") == WIDTH
    with pytest.raises(
        ConfigError,
        match="'vip' is not available for dpcap-nano: DP-Cap encoders offer dpcap, avg, cls",
    ):
        enc.embed(x, "vip")


def test_vip_repos_refuse_the_dpcap_mode(tiny_repo):
    enc = load_encoder(tiny_repo)
    assert enc.poolings == ("vip", "avg", "cls", "spatial-b4-g2", "spatial-b8-g2", "pixels")
    with pytest.raises(
        ConfigError, match="'dpcap' is not available for vip-nano: ViP encoders offer vip, avg, cls"
    ):
        enc.embed(torch.zeros(1, 3, 32, 32), "dpcap")
    block = json.loads((tiny_repo / CONFIG_FILE).read_text())[CONFIG_BLOCK]
    assert list(block["feature_dims"]) == [
        "vip",
        "avg",
        "cls",
        "spatial-b4-g2",
        "spatial-b8-g2",
    ]


def test_decoder_logits_and_per_example_loss_match_the_reference(reference, repo):
    ref, _ = reference
    cap = load_captioner(repo)
    x = images(4)
    texts = cap.tokenizer.encode(
        ["a dog on the beach", "two red cars", "a photo", "the cat is sitting near a window"]
    )
    assert texts[2].tolist()[-1] == 0  # padded
    with torch.no_grad():
        want_logits, want_loss = ref.logits(x, texts), ref.loss(x, texts)
        got_logits = cap.captioner.decoder(cap.captioner.encode(x), texts)
        got_loss = cap.captioner(x, texts)
        alone = cap.captioner(
            x[1:2], texts[1:2]
        )  # each example's loss depends on that example only
    torch.testing.assert_close(got_logits, want_logits, atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(got_loss, want_loss, atol=1e-5, rtol=1e-5)
    assert got_loss.shape == (4,)
    torch.testing.assert_close(alone, got_loss[1:2], atol=1e-5, rtol=1e-5)


def test_greedy_captions_and_zero_shot_match_the_reference(reference, repo):
    ref, _ = reference
    cap = load_captioner(repo)
    x = images(3, seed=5)
    ids = cap.captioner.generate(x, max_tokens=6)
    with torch.no_grad():
        assert ids == [ref.greedy(img, 6) for img in x]
    assert cap.caption(x, max_tokens=6) == [cap.tokenizer.decode(row) for row in ids]
    assert cap.max_tokens == TEXT_LEN - 1
    labels = ["dog", "red car", "handwritten digit zero"]
    losses = cap.zero_shot(x, labels)
    prompt = cap.tokenizer.encode(["this is a photo of a"])[0].tolist()[
        :-1
    ]  # the README's prompt, [SEP] dropped
    with torch.no_grad():
        for i, label in enumerate(labels):
            text = torch.tensor(
                [prompt + cap.tokenizer.encode([label])[0].tolist()[1:]]
            )  # label after its [CLS]
            out = ref.logits(x, text.expand(3, -1)).permute(0, 2, 1)
            want = torch.stack(
                [F.cross_entropy(out[b : b + 1, :, :-1], text[:, 1:]) for b in range(3)]
            )
            torch.testing.assert_close(losses[:, i], want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="max_tokens must be between 1 and 15"):
        cap.captioner.generate(x, max_tokens=40)


# ------------------------------------------------------------------------- import refusals
def test_import_refuses_pickled_code(reference, tmp_path):
    ref, _ = reference
    bad = save_reference(ref, tmp_path / "evil.pth", hook=os.system)
    with pytest.raises(CheckpointError, match="refused.*system"):
        import_dpcap_checkpoint(
            bad,
            tmp_path / "out",
            arch=ARCH,
            img_size=IMG,
            stages=[synthetic_stage()],
            model_name="x",
        )
    assert not (tmp_path / "out").exists()


def test_import_names_wrong_shapes_missing_and_unexpected_keys(reference, tmp_path):
    ref, path = reference
    with pytest.raises(
        CheckpointError,
        match=r"shape mismatches for dpcap-tiny at 32px: .*blocks\.0\.attn\.qkv\.weight "
        r"\(576, 192\) \(expected \(1152, 384\)\)",
    ):
        import_dpcap_checkpoint(
            path,
            tmp_path / "a",
            arch="dpcap-tiny",
            img_size=IMG,
            stages=[synthetic_stage()],
            model_name="x",
        )
    state = {
        k: v
        for k, v in ref.state_dict().items()
        if k not in ("encoder_image_type_embedding", "decoder.layers.1.linear2.weight")
    }
    state["extra_head.weight"] = torch.zeros(2)
    odd = tmp_path / "odd.pth"
    torch.save({"model": state, "args": argparse.Namespace()}, odd)
    with pytest.raises(CheckpointError) as err:
        import_dpcap_checkpoint(
            odd, tmp_path / "b", arch=ARCH, img_size=IMG, stages=[synthetic_stage()], model_name="x"
        )
    msg = str(err.value)
    assert "missing keys: decoder.layers.1.linear2.weight, encoder_image_type_embedding" in msg
    assert "unexpected keys: extra_head.weight" in msg
    with pytest.raises(ConfigError, match="not a DP-Cap architecture"):
        import_dpcap_checkpoint(
            path,
            tmp_path / "c",
            arch="vip-nano",
            img_size=IMG,
            stages=[synthetic_stage()],
            model_name="x",
        )
    for vocab, error in ((tmp_path / "none.txt", MissingInputError), (tmp_path, ConfigError)):
        with pytest.raises(error, match=f"{vocab}: .*vocabulary file"):  # was an OSError, late
            import_dpcap_checkpoint(
                path,
                tmp_path / "d",
                arch=ARCH,
                img_size=IMG,
                vocab=vocab,
                stages=[synthetic_stage()],
                model_name="x",
            )
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize(
    ("key", "shape"),
    [
        ("decoder_embed.weight", ()),
        ("decoder_embed.weight", (0, 192)),
        ("text_decoder_pos_embed", (40,)),
        ("decoder.layers.0.linear1.weight", ()),
    ],
)
def test_import_names_a_sizing_tensor_of_the_wrong_dimensions(reference, tmp_path, key, shape):
    """The text decoder's sizes are read from four tensors: one of the wrong number of
    dimensions, or empty, was an IndexError or a ZeroDivisionError; now named."""
    ref, _ = reference
    state = ref.state_dict() | {key: torch.zeros(shape)}
    odd = tmp_path / "odd.pth"
    torch.save({"model": state, "args": argparse.Namespace()}, odd)
    with pytest.raises(CheckpointError, match=rf"{re.escape(key)} has shape"):
        import_dpcap_checkpoint(
            odd, tmp_path / "b", arch=ARCH, img_size=IMG, stages=[synthetic_stage()], model_name="x"
        )


def test_import_refuses_a_vocabulary_that_does_not_fit(reference, tmp_path):
    _, path = reference
    short = tmp_path / "short.txt"
    short.write_text("\n".join(VOCAB[:-5]) + "\n")
    with pytest.raises(
        ConfigError,
        match=r"vocabulary's \(size, \[CLS\], \[SEP\], \[PAD\]\) = \(\d+, 101, 102, 0\) "
        r"does not match",
    ):
        import_dpcap_checkpoint(
            path,
            tmp_path / "a",
            arch=ARCH,
            img_size=IMG,
            stages=[synthetic_stage()],
            model_name="x",
            vocab=short,
        )
    nosep = tmp_path / "nosep.txt"
    nosep.write_text("\n".join(v for v in VOCAB if v != "[SEP]") + "\n")
    with pytest.raises(ConfigError, match=r"lacks the special tokens \[SEP\]"):
        CaptionTokenizer(nosep)


def test_a_text_decoder_replaced_after_verification_is_refused(repo, tmp_path, monkeypatch):
    """The text decoder file read after verify (its image memory by load_encoder, all of it by
    the captioner) must be the one the ledger binds; without verification it loads as before."""
    copy = shutil.copytree(repo, tmp_path / "repo")
    enc = load_encoder(copy)
    with monkeypatch.context() as m:
        swap_after_verify(m, copy / TEXT_DECODER_FILE)
        with pytest.raises(TamperedFileError, match=f"{TEXT_DECODER_FILE}: changed after verif"):
            load_encoder(copy)
    with pytest.raises(TamperedFileError, match=f"{TEXT_DECODER_FILE}: changed after verif"):
        CaptioningModel.from_encoder(enc)  # verified before the swap, its decoder read after
    assert load_captioner(copy, verify=False).encoder.memory is not None


def test_a_text_decoder_configuration_changed_is_refused(repo, tmp_path, monkeypatch):
    """A text decoder's configuration (its metadata, which the tensors digest leaves out) shapes
    every caption without changing a tensor: other heads or token ids fail ``verify`` against
    the configuration ``CONFIG_FILE`` binds, and a change after verification fails the load."""
    copy = shutil.copytree(repo, tmp_path / "repo")
    path = copy / TEXT_DECODER_FILE
    original = path.read_bytes()
    bound = json.loads(read_safetensors_metadata(path)[META_DECODER])

    def other(meta: dict[str, str]) -> dict[str, str]:
        return {**meta, META_DECODER: json.dumps({**bound, "num_heads": 1})}

    rewrite_safetensors_metadata(path, other(read_safetensors_metadata(path)))
    problems = "; ".join(map(str, verify_repo(copy).problems))
    assert f"{TEXT_DECODER_FILE}: its metadata's configuration is not" in problems, problems
    path.write_bytes(original)
    enc = load_encoder(copy)
    with monkeypatch.context() as m:
        swap_after_verify(m, path, lambda t: t, other)
        with pytest.raises(TamperedFileError, match="changed after verification: its config"):
            load_encoder(copy)
    with pytest.raises(TamperedFileError, match="changed after verification: its config"):
        CaptioningModel.from_encoder(enc)  # verified before the change, its decoder read after


def test_a_vocabulary_replaced_after_verification_is_refused(repo, tmp_path):
    """The vocabulary the captioner reads after the repo verified must be the one the ledger
    binds: another vocabulary (its words in another order) swapped in between would caption and
    label in other words; without verification it loads as before."""
    copy = shutil.copytree(repo, tmp_path / "repo")
    enc = load_encoder(copy)
    lines = (copy / VOCAB_FILE).read_text().splitlines()
    (copy / VOCAB_FILE).write_text("\n".join([*lines[:-2], lines[-1], lines[-2]]) + "\n")
    with pytest.raises(TamperedFileError, match=f"{VOCAB_FILE}: changed after verification"):
        CaptioningModel.from_encoder(enc)
    assert load_captioner(copy, verify=False).tokenizer.vocab_size == len(lines)


def test_repo_without_vocabulary_embeds_but_cannot_caption(reference, tmp_path):
    _, path = reference
    out = import_dpcap_checkpoint(
        path,
        tmp_path / "novocab",
        arch=ARCH,
        img_size=IMG,
        stages=[synthetic_stage()],
        model_name="novocab",
    )
    enc = load_encoder(out)
    assert enc.poolings[:3] == ("dpcap", "avg", "cls") and not enc.can_caption
    with pytest.raises(MissingInputError, match=f"has no {VOCAB_FILE}: it cannot caption"):
        load_captioner(out)
    assert "Captioning | not available" in (out / CARD_FILE).read_text()


# ------------------------------------------------------------------------ tokenizer, model
def test_tokenizer_follows_the_reference_conventions(tmp_path):
    tok = CaptionTokenizer(write_vocab(tmp_path / VOCAB_FILE))
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.max_length) == (101, 102, 0, 40)
    ids = tok.encode(["Two DOGS playing.", "a"])
    word = VOCAB.index
    assert ids[0].tolist() == [
        101,
        word("two"),
        word("dog"),
        word("##s"),
        word("playing"),
        word("."),
        102,
    ]
    assert ids[1].tolist() == [101, word("a"), 102, 0, 0, 0, 0]
    assert tok.decode(ids[0].tolist()) == "two dogs playing."
    long = tok.encode(["dog " * 100])[0].tolist()
    assert len(long) == 40 and long[-1] == 102


def test_text_decoder_is_clippable_per_example():
    """Only Linear, LayerNorm and Embedding hold parameters, each runs once per forward, nothing
    is tied, and the constants are buffers (what training.dp.clipping.PerExampleClipper needs)."""
    torch.manual_seed(0)
    spec = EncoderSpec(ARCH, img_size=IMG)
    decoder = TextDecoder(
        TextDecoderConfig.for_encoder(
            spec,
            width=48,
            depth=2,
            num_heads=4,
            vocab_size=50,
            max_length=8,
            bos_id=1,
            eos_id=2,
            pad_id=0,
        )
    )
    model = Captioner(create_encoder(spec, mae_init=True), decoder)
    assert not model.encoder.cls_token.requires_grad and not model.encoder.pos_embed.requires_grad
    holders = [
        m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))
    ]
    assert all(isinstance(m, (nn.Linear, nn.LayerNorm, nn.Embedding, nn.Conv2d)) for m in holders)
    assert len({p.data_ptr() for p in model.parameters()}) == len(list(model.parameters()))
    calls: dict[nn.Module, int] = {}
    hooks = [
        m.register_forward_hook(lambda m, i, o: calls.__setitem__(m, calls.get(m, 0) + 1))
        for m in holders
    ]
    text = torch.tensor([[1, 5, 6, 2, 0], [1, 7, 2, 0, 0]])
    losses = model(torch.randn(2, 3, IMG, IMG), text)
    for h in hooks:
        h.remove()
    assert losses.shape == (2,) and set(calls.values()) == {1} and len(calls) == len(holders)
    logits = torch.randn(2, 5, 50)
    ce = [F.cross_entropy(logits[i, :-1], text[i, 1:], reduction="none") for i in range(2)]
    torch.testing.assert_close(
        caption_loss(logits, text, 0), torch.stack([ce[0][:3].mean(), ce[1][:2].mean()])
    )
    with pytest.raises(ConfigError, match="final norm on every token"):
        Captioner(
            tiny_encoder(),
            TextDecoder(
                TextDecoderConfig.for_encoder(
                    EncoderSpec("vip-nano", img_size=IMG), vocab_size=50, bos_id=1, eos_id=2
                )
            ),
        )


def test_export_refuses_text_parts_that_do_not_belong(tmp_path):
    spec = EncoderSpec("vip-nano", img_size=IMG)
    decoder = TextDecoder(
        TextDecoderConfig.for_encoder(
            EncoderSpec(ARCH, img_size=IMG), width=48, depth=1, num_heads=4, vocab_size=len(VOCAB)
        )
    )
    with pytest.raises(ConfigError, match="ViP repos carry no text decoder"):
        export_encoder(
            tmp_path / "a",
            tiny_encoder(),
            spec,
            [synthetic_stage()],
            model_name="a",
            text_decoder=decoder,
        )
    with pytest.raises(ConfigError, match="only exported with the text decoder"):
        export_encoder(
            tmp_path / "b",
            tiny_encoder(),
            spec,
            [synthetic_stage()],
            model_name="b",
            vocab=b"[PAD]\n",
        )


# ------------------------------------------------------------------- preset, ledger, card
def test_preset_ledger_verifies_and_the_card_says_what_was_sampled(repo, tmp_path):
    preset = PRESETS["dpcap-base-eps7"]()
    assert preset.arch == "dpcap-base" and preset.license == "cc-by-nc-4.0"
    dp = preset.stages[-1]
    assert dp.dataset.name == "MetaCLIP" and dp.dataset.size == 2_000_000_000
    assert (dp.noise_multiplier, dp.steps, dp.clipping_norm, dp.expected_batch_size) == (
        0.527,
        5000,
        1.0,
        1_310_720,
    )
    assert dp.delta == pytest.approx(5e-10) and dp.sampling == "shuffle"
    assert dp.epsilon == pytest.approx(7.30, abs=0.01)  # RDP; the README calls it the eps = 7 model
    assert set(dp.reference_epsilon) == {"prv", "pld"} and all(
        6.2 < e < 6.4 for e in dp.reference_epsilon.values()
    )
    # The ledger on a small DP-Cap repo (the base weights are not needed to check the record).
    enc = create_encoder(EncoderSpec(ARCH, img_size=IMG), mae_init=True)
    cap = load_captioner(repo)
    out = export_encoder(
        tmp_path / "eps7",
        enc,
        EncoderSpec(ARCH, img_size=IMG),
        preset.stages,
        model_name="dpcap-eps7-small",
        text_decoder=cap.captioner.decoder,
        vocab=(repo / VOCAB_FILE).read_bytes(),
        license=preset.license,
    )
    report = verify_repo(out)
    assert report.ok, report.problems
    assert report.recomputed["dp-pretraining/rdp"] == pytest.approx(dp.epsilon, rel=1e-4)
    assert set(json.loads((out / LEDGER_FILE).read_text())["artifacts"]) == {
        WEIGHTS_FILE,
        CONFIG_FILE,
        TEXT_DECODER_FILE,
        VOCAB_FILE,
    }
    card = (out / CARD_FILE).read_text()
    assert "Sampling caveat for `dp-pretraining`" in card and "assumes Poisson sampling" in card
    assert (
        "for any single image-caption pair of `MetaCLIP" in card
        and "one image-caption pair" in card
    )
    assert (
        "`dpcap-nano` (DP-Cap family)" in card and "no qkv bias, final norm on every token" in card
    )
    assert (
        "`dpcap` 96, `avg` 192, `cls` 192" in card
        and "## Captions and zero-shot classification" in card
    )
    assert (
        'pooling="dpcap"' in card
        and "license: cc-by-nc-4.0" in card
        and "shuffle (accounted as Poisson)" in card
    )
    (out / VOCAB_FILE).write_text("tampered\n")
    assert not verify_repo(out).ok


def test_vip_cards_stay_vip(tiny_repo):
    card = (tiny_repo / CARD_FILE).read_text()
    assert "`vip-nano` (ViP family)" in card and "`vip` 1152, `avg` 192, `cls` 192" in card
    assert "Captions" not in card and "Captioning" not in card and 'pooling="vip"' in card


# ----------------------------------------------------------------------------------- CLI
def test_cli_import_caption_and_zero_shot(reference, tmp_path, capsys):
    _, path = reference
    out = tmp_path / "cli-repo"
    vocab = write_vocab(tmp_path / VOCAB_FILE)
    assert (
        main(
            [
                "import-dpcap",
                str(path),
                "--out",
                str(out),
                "--arch",
                ARCH,
                "--img-size",
                str(IMG),
                "--vocab",
                str(vocab),
                "--synthetic-dataset",
                "Shaders21k",
                "--private-dataset",
                "captions",
                "--dataset-size",
                "10000",
                "--sigma",
                "1.0",
                "--batch-size",
                "100",
                "--steps",
                "10",
                "--clip",
                "1",
            ]
        )
        == 0
    )
    dp = json.loads((out / LEDGER_FILE).read_text())["stages"][1]
    assert dp["sampling"] == "shuffle" and dp["delta"] == pytest.approx(
        1e-4
    )  # the reference's defaults
    assert "license: cc-by-nc-4.0" in (out / CARD_FILE).read_text()  # the DP-Cap authors'
    from PIL import Image

    files = []
    for i, color in enumerate(("red", "blue")):
        files.append(tmp_path / f"{i}.png")
        Image.new("RGB", (40, 40), color).save(files[-1])
    capsys.readouterr()
    assert main(["caption", str(out), *map(str, files), "--max-tokens", "5", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    expected = load_captioner(out, verify=False).caption(
        [Image.open(f).convert("RGB") for f in files], max_tokens=5
    )
    assert [c["caption"] for c in result["captions"]] == expected
    assert result["privacy"]["epsilon"] > 0
    assert (
        main(["zero-shot", str(out), str(files[0]), "--labels", "dog,cat,red car", "--json"]) == 0
    )
    zs = json.loads(capsys.readouterr().out)["results"][0]
    losses = [entry["loss"] for entry in zs["labels"]]
    assert losses == sorted(losses) and zs["label"] == zs["labels"][0]["label"]
    assert main(["zero-shot", str(out), str(files[0]), "--labels", "dog,cat", "--top-k", "1"]) == 0
    line, headline = capsys.readouterr().out.splitlines()
    assert line.startswith(f"{files[0]}: ") and line.endswith(")")
    assert headline.startswith("model privacy: (ε = ")
    assert main(["caption", str(out), *map(str, files), "--max-tokens", "5"]) == 0
    assert capsys.readouterr().out.splitlines()[:2] == [
        f"{f}: {c}" for f, c in zip(files, expected, strict=True)
    ]
    assert main(["zero-shot", str(out), str(files[0]), "--labels", "dog,,cat"]) == 1
    assert "labels[1] is empty" in capsys.readouterr().err
    # a byte the shell could not decode: was the tokenizer's TypeError traceback
    assert main(["zero-shot", str(out), str(files[0]), "--labels", "dog,caf\udcc3"]) == 1
    assert "'caf\\udcc3') is not Unicode text" in capsys.readouterr().err
    assert (
        main(["zero-shot", str(out), str(files[0]), "--labels", "dog", "--prompt", "\udcff"]) == 1
    )
    assert "is not Unicode text" in capsys.readouterr().err
    assert main(["caption", str(out), str(tmp_path / "missing.png")]) == 1
    assert "missing.png: no such image file" in capsys.readouterr().err
    bomb = tmp_path / "bomb.png"
    Image.new("1", (14_000, 14_000)).save(bomb)  # a few kB, past Pillow's bomb limit
    assert main(["caption", str(out), str(bomb)]) == 1  # was DecompressionBombError's traceback
    assert "bomb.png: not a readable image" in capsys.readouterr().err


def test_probe_trains_on_dpcap_features(repo, tmp_path):
    from PIL import Image

    from training.recipes.probe import ProbeConfig, run_probe
    from vip_hub.repo.heads import load_head

    data = tmp_path / "labelled"
    for label, color in (("red", (200, 30, 30)), ("blue", (30, 30, 200))):
        (data / label).mkdir(parents=True)
        for i in range(8):
            Image.new("RGB", (32, 32), tuple(min(255, c + 6 * i) for c in color)).save(
                data / label / f"{i}.png"
            )
    out = tmp_path / "with-head"
    r = run_probe(
        ProbeConfig(
            encoder=str(repo),
            data=str(data),
            test_fraction=0.5,
            head="colors",
            pooling="dpcap",
            epochs=3,
            warmup_epochs=1,
            batch_size=8,
            out=str(out),
            dataset_name="test/colors",
        )
    )
    assert r.features["train_x"].shape[1] == WIDTH
    head, info = load_head(out, "colors")
    assert info.pooling == "dpcap" and head.linear.in_features == WIDTH
    assert verify_repo(out).ok


def test_a_dpcap_decoder_whose_hidden_width_is_no_float_multiple_imports(tmp_path):
    """The text decoder's MLP width is read as hidden / width and rebuilt as int(width * ratio):
    a valid checkpoint of width 84 and hidden 102 was refused, "expected (101, 84)"."""
    torch.manual_seed(6)
    state = ReferenceDPCap(width=84, dec_heads=6).state_dict()
    for key in list(state):
        if key.endswith("linear1.weight"):
            state[key] = torch.randn(102, 84) * 0.05
        elif key.endswith("linear2.weight"):
            state[key] = torch.randn(84, 102) * 0.05
    torch.save({"model": state, "args": argparse.Namespace()}, tmp_path / "ckpt.pth")
    out = import_dpcap_checkpoint(
        tmp_path / "ckpt.pth",
        tmp_path / "repo",
        arch=ARCH,
        img_size=IMG,
        stages=[synthetic_stage()],
        model_name="x",
    )
    assert verify_repo(out).ok
    decoder = load_text_decoder(out / TEXT_DECODER_FILE)  # the loader rebuilds the same widths
    assert decoder.blocks[0].mlp.fc1.weight.shape == (102, 84)
