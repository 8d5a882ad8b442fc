"""Import of checkpoints in the ViP-MAE reference layout (built here: nothing can be downloaded)."""

import argparse
import functools
import json
import os
import warnings
import zipfile

import pytest
import torch
from support.helpers import import_nano
from timm.layers import PatchEmbed
from timm.models.vision_transformer import Block

from vip_hub import load_encoder, verify_repo
from vip_hub.cli.main import main
from vip_hub.models.encoders import ARCHS, sincos_pos_embed_2d
from vip_hub.repo.artifacts import read_safetensors_metadata
from vip_hub.repo.importer import (
    PRESETS,
    CheckpointError,
    load_reference_checkpoint,
)
from vip_hub.repo_format import CARD_FILE, MAE_DECODER_FILE, META_DECODER


class ReferenceMAE(torch.nn.Module):
    """The module layout (and so the keys) of ViP-MAE's MaskedAutoencoderViT."""

    def __init__(self, arch="vip-nano", img_size=32, decoder_depth=2):
        super().__init__()
        a = ARCHS[arch]
        norm = functools.partial(torch.nn.LayerNorm, eps=1e-6)
        self.patch_embed = PatchEmbed(img_size, 16, 3, a.embed_dim)
        n = self.patch_embed.num_patches
        self.cls_token = torch.nn.Parameter(torch.randn(1, 1, a.embed_dim) * 0.02)
        self.pos_embed = torch.nn.Parameter(
            sincos_pos_embed_2d(a.embed_dim, int(n**0.5))[None], requires_grad=False
        )
        self.blocks = torch.nn.ModuleList(
            [
                Block(a.embed_dim, a.num_heads, 4.0, qkv_bias=True, norm_layer=norm)
                for _ in range(a.depth)
            ]
        )
        self.norm = norm(a.embed_dim)
        self.decoder_embed = torch.nn.Linear(a.embed_dim, 512)
        self.mask_token = torch.nn.Parameter(torch.zeros(1, 1, 512))
        self.decoder_pos_embed = torch.nn.Parameter(torch.zeros(1, n + 1, 512), requires_grad=False)
        self.decoder_blocks = torch.nn.ModuleList(
            [Block(512, 16, 4.0, qkv_bias=True, norm_layer=norm) for _ in range(decoder_depth)]
        )
        self.decoder_norm = norm(512)
        self.decoder_pred = torch.nn.Linear(512, 16 * 16 * 3)
        for p in self.parameters():  # not the zero init of a fresh model: every weight matters
            if p.requires_grad:
                torch.nn.init.normal_(p, std=0.05)

    def encode(self, imgs):
        """The reference forward_encoder with no masking: (cls token, mean patch token)."""
        x = self.patch_embed(imgs) + self.pos_embed[:, 1:]
        cls = (self.cls_token + self.pos_embed[:, :1]).expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1)
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)[:, 0], self.norm(x[:, 1:].mean(1))


@pytest.fixture
def reference(tmp_path):
    torch.manual_seed(0)
    mae = ReferenceMAE().eval()
    path = tmp_path / "checkpoint-799.pth"
    torch.save(
        {
            "model": mae.state_dict(),
            "epoch": 799,
            "args": argparse.Namespace(model="mae_vit_nano_dec512d4b", mask_ratio=0.75),
        },
        path,
    )
    return mae, path


def test_converted_encoder_matches_source(reference, tmp_path):
    mae, path = reference
    out = import_nano(path, tmp_path / "repo", name="imported")
    assert verify_repo(out).ok
    enc = load_encoder(out)
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        ref_cls, ref_avg = mae.encode(x)
        ours = enc.embed(x, "cls"), enc.embed(x, "avg")
    torch.testing.assert_close(ours[0], ref_cls, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours[1], ref_avg, atol=1e-5, rtol=1e-5)
    from safetensors.torch import load_file

    decoder = load_file(out / MAE_DECODER_FILE)
    assert set(decoder) == {
        k for k in mae.state_dict() if k.startswith("decoder_") or k == "mask_token"
    }


def test_encoder_only_checkpoint(tmp_path):
    torch.manual_seed(1)
    mae = ReferenceMAE()
    state = {
        k: v for k, v in mae.state_dict().items() if not k.startswith(("decoder_", "mask_token"))
    }
    state["head.weight"] = torch.zeros(10, 192)  # a fine-tuned classifier is dropped
    torch.save(state, tmp_path / "enc.pth")
    out = import_nano(tmp_path / "enc.pth", tmp_path / "repo", name="enc")
    assert not (out / MAE_DECODER_FILE).exists()


def test_mismatches_list_the_keys(reference, tmp_path):
    _, path = reference
    with pytest.raises(
        CheckpointError,
        match=r"shape mismatches for vip-tiny.*cls_token \(1, 1, 192\) \(expected \(1, 1, 384\)\)",
    ):
        import_nano(path, tmp_path / "r", arch="vip-tiny")
    state = torch.load(path, weights_only=False)["model"]
    del state["blocks.3.mlp.fc1.weight"]
    state["extra.thing"] = torch.zeros(1)
    torch.save({"model": state}, tmp_path / "broken.pth")
    with pytest.raises(
        CheckpointError,
        match=r"missing encoder keys: blocks\.3\.mlp\.fc1\.weight; unexpected keys: extra\.thing",
    ):
        import_nano(tmp_path / "broken.pth", tmp_path / "r")
    assert not (tmp_path / "r").exists()


class Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/vip-hub-pwned",))


def test_pickled_code_is_refused(tmp_path):
    torch.save({"model": {"w": torch.zeros(1)}, "evil": Payload()}, tmp_path / "evil.pth")
    with pytest.raises(CheckpointError, match="refused, the file holds objects other than tensors"):
        load_reference_checkpoint(tmp_path / "evil.pth")
    assert not os.path.exists("/tmp/vip-hub-pwned")
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="not a readable PyTorch checkpoint"):
        load_reference_checkpoint(tmp_path / "junk.pth")


def test_a_corrupt_old_style_checkpoint_is_named_whatever_the_unpickler_raises(tmp_path, capsys):
    """Bytes of a legacy (non-zip) checkpoint overwritten one at a time: the unpickler raised
    KeyError, IndexError, UnicodeDecodeError, AssertionError, TypeError..., each a traceback
    from ``import-mae``; every one is now a CheckpointError."""
    path = tmp_path / "old.pth"
    torch.save({"model": {"w": torch.zeros(4, 4)}}, path, _use_new_zipfile_serialization=False)
    data, corrupt, raised = path.read_bytes(), tmp_path / "corrupt.pth", set()
    for at in range(len(data) - 64):  # the pickles before the tensor bytes
        for value in (0x00, 0x80, 0xFF):
            corrupt.write_bytes(data[:at] + bytes([value]) + data[at + 1 :])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "Detected pickle protocol 115 ..."
                try:
                    load_reference_checkpoint(corrupt)
                except CheckpointError as e:
                    raised.add(type(e.__context__).__name__)
    assert {"IndexError", "UnicodeDecodeError", "AssertionError"} <= raised, raised
    corrupt.write_bytes(data[:200] + b"\xff" + data[201:])
    args = ["import-mae", str(corrupt), "--arch", "vip-nano", "--out", str(tmp_path / "out")]
    assert main([*args, "--synthetic-dataset", "Shaders21k"]) == 1
    assert "not a readable PyTorch checkpoint" in capsys.readouterr().err


def test_compressed_checkpoint_is_refused(tmp_path):
    # torch.save stores its records uncompressed; a deflated one turns a small file into as much
    # memory as its header claims (here over 100 times the file)
    torch.save({"model": {"w": torch.zeros(2**22)}}, tmp_path / "plain.pth")
    bomb = tmp_path / "bomb.pth"
    with (
        zipfile.ZipFile(tmp_path / "plain.pth") as src,
        zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as dst,
    ):
        for name in src.namelist():
            dst.writestr(name, src.read(name))
    assert bomb.stat().st_size < 2**22 // 100
    with pytest.raises(
        CheckpointError, match=r"bomb\.pth: refused, its record plain/data\.pkl is compressed"
    ):
        load_reference_checkpoint(bomb)


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, device="meta")


def _shared(state: dict) -> None:
    state["norm.bias"] = state["norm.weight"]


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda s: s.__setitem__(7, torch.zeros(1)), "the key 7 is not a string"),
        (lambda s: s.__setitem__("cls_token", _meta(s["cls_token"])), "cls_token holds no data"),
        (lambda s: s.__setitem__("norm.weight", s["norm.weight"].to_sparse()), "norm.weight is"),
        (lambda s: s.__setitem__("cls_token", s["cls_token"].long()), "cls_token is torch.int64"),
        (lambda s: s.__setitem__("cls_token", s["cls_token"].cfloat()), "cls_token is torch.comp"),
        (  # 4 stored bytes that would be written out as 4 MB
            lambda s: s.__setitem__("decoder_x", torch.zeros(1).expand(1000, 1000)),
            "decoder_x has 1000000 elements but 1 stored",
        ),
        (_shared, "norm.bias and norm.weight share"),
    ],
    ids=["int-key", "meta", "sparse", "int64", "complex", "stride-0", "shared"],
)
@pytest.mark.filterwarnings("ignore:Validating sparse tensor invariants")  # torch's, loading
def test_unusable_tensors_are_refused(tmp_path, change, problem):
    state = {k: v for k, v in ReferenceMAE().state_dict().items() if not k.startswith("decoder")}
    change(state)
    torch.save({"model": state}, tmp_path / "odd.pth")
    with pytest.raises(CheckpointError, match=rf"odd\.pth: .*{problem}"):
        import_nano(tmp_path / "odd.pth", tmp_path / "repo")
    assert not (tmp_path / "repo").exists()


@pytest.mark.parametrize("where", ["the checkpoint", "its folder"])
def test_out_that_holds_the_checkpoint_is_refused(reference, tmp_path, capsys, where):
    _, path = reference
    before = path.read_bytes()
    out = path if where == "the checkpoint" else path.parent
    args = ["import-mae", str(path), "--arch", "vip-nano", "--img-size", "32", "--out", str(out)]
    assert main([*args, "--overwrite", "--synthetic-dataset", "Shaders21k"]) == 1
    assert "would replace the checkpoint" in capsys.readouterr().err
    assert path.read_bytes() == before


def test_presets():
    syn = PRESETS["vip-syn-base"]()
    assert syn.arch == "vip-base" and [s.type for s in syn.stages] == ["non-private"]
    base = PRESETS["vip-base"]()
    dp = base.stages[1]
    assert (dp.noise_multiplier, dp.steps, dp.clipping_norm, dp.expected_batch_size) == (
        0.5,
        10_000,
        0.1,
        81_920,
    )
    assert dp.delta == pytest.approx(1 / (2 * 233_000_000))
    assert dp.epsilon == pytest.approx(7.00, abs=0.01) and dp.reference_epsilon[
        "prv"
    ] == pytest.approx(5.98, abs=0.02)


def test_cli_import_with_ledger_options(reference, tmp_path, capsys):
    _, path = reference
    out = tmp_path / "cli-repo"
    code = main(
        [
            "import-mae",
            str(path),
            "--arch",
            "vip-nano",
            "--img-size",
            "32",
            "--out",
            str(out),
            "--synthetic-dataset",
            "Shaders21k",
            "--private-dataset",
            "my-images",
            "--dataset-size",
            "5000",
            "--sigma",
            "1.0",
            "--batch-size",
            "100",
            "--steps",
            "50",
            "--clip",
            "0.1",
        ]
    )
    assert code == 0, capsys.readouterr().err
    report = verify_repo(out)
    assert report.ok and report.ledger.guarantees[0].dataset == "my-images"
    assert (
        main(
            [
                "import-mae",
                str(path),
                "--arch",
                "vip-nano",
                "--out",
                str(tmp_path / "x"),
                "--sigma",
                "1",
            ]
        )
        == 1
    )
    assert "a DP stage needs" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_preset_vip_base(tmp_path, capsys):
    torch.manual_seed(2)
    mae = ReferenceMAE("vip-base", img_size=32, decoder_depth=4)
    torch.save({"model": mae.state_dict()}, tmp_path / "vip-base.pth")
    out = tmp_path / "vip-base"
    assert (
        main(
            [
                "import-mae",
                str(tmp_path / "vip-base.pth"),
                "--preset",
                "vip-base",
                "--img-size",
                "32",
                "--out",
                str(out),
                "--repo-id",
                "vip/vip-base",
            ]
        )
        == 0
    ), capsys.readouterr().err
    report = verify_repo(out)
    assert report.ok
    assert report.ledger.summary().datasets == ("LAION-233M",)
    assert "hf-hub:vip/vip-base" in (out / CARD_FILE).read_text()


def test_non_finite_weights_are_refused_naming_the_tensors(tmp_path):
    """A NaN in an encoder weight and an infinity in the MAE decoder refuse the import, naming
    both tensors as the checkpoint does; nothing is written."""
    torch.manual_seed(3)
    state = ReferenceMAE().state_dict()
    state["blocks.1.attn.qkv.weight"][3, 5] = float("nan")
    state["decoder_pred.bias"][0] = float("-inf")
    torch.save({"model": state}, tmp_path / "nan.pth")
    with pytest.raises(
        CheckpointError,
        match=r"nan\.pth: refused, NaN or infinite values in blocks\.1\.attn\.qkv\.weight, "
        r"decoder_pred\.bias",
    ):
        import_nano(tmp_path / "nan.pth", tmp_path / "repo")
    assert not (tmp_path / "repo").exists()


def test_a_decoder_that_is_not_an_mae_decoder_is_refused_naming_the_tensors(tmp_path):
    """The decoder_* tensors are held to an MAE decoder of the width and depth they show: a
    tensor of another shape and a missing one refuse the import (not only a later training
    load); a whole decoder imports with the configuration the training load reads."""
    torch.manual_seed(4)
    state = ReferenceMAE().state_dict()
    state["decoder_pred.weight"] = torch.zeros(16 * 16 * 3, 256)
    del state["decoder_norm.bias"]
    torch.save({"model": state}, tmp_path / "odd-decoder.pth")
    with pytest.raises(
        CheckpointError,
        match=r"odd-decoder\.pth: refused, its decoder_\* tensors are not an MAE decoder 512 wide "
        r"and 2 blocks deep for vip-nano at 32px: missing keys: decoder_norm\.bias; shape "
        r"mismatches: decoder_pred\.weight \(768, 256\) \(expected \(768, 512\)\)",
    ):
        import_nano(tmp_path / "odd-decoder.pth", tmp_path / "repo")
    assert not (tmp_path / "repo").exists()

    torch.save({"model": ReferenceMAE().state_dict()}, tmp_path / "whole.pth")
    out = import_nano(tmp_path / "whole.pth", tmp_path / "repo")
    meta = read_safetensors_metadata(out / MAE_DECODER_FILE)
    assert json.loads(meta[META_DECODER]) == {"dim": 512, "depth": 2, "num_heads": 16}


def test_a_checkpoint_with_both_norm_and_fc_norm_is_refused(tmp_path):
    """``norm.*`` is renamed ``fc_norm.*``: a checkpoint holding both names one tensor twice, and
    one of them was silently dropped."""
    torch.manual_seed(5)
    state = ReferenceMAE().state_dict()
    state["fc_norm.weight"] = torch.full_like(state["norm.weight"], 7.0)
    state["fc_norm.bias"] = torch.zeros_like(state["norm.bias"])
    torch.save({"model": state}, tmp_path / "both.pth")
    with pytest.raises(CheckpointError, match=r"norm\.weight.*fc_norm\.weight"):
        import_nano(tmp_path / "both.pth", tmp_path / "repo")
    assert not (tmp_path / "repo").exists()


@pytest.mark.parametrize(
    "option, value",
    [
        ("--name", "../../evil"),
        ("--name", "caf\udcc3"),
        ("--out", "caf\udcc3"),
        ("--repo-id", "a/b/c"),
    ],
)
def test_a_repo_id_the_hub_client_would_not_send_is_refused_before_writing(
    reference, tmp_path, capsys, option, value
):
    """``--name ../../evil`` put ``vip/../../evil`` on the card and the repo verified; a name
    (or ``--out`` folder) holding a byte the shell could not decode crashed in the card's
    encoding, a traceback after the weights were written."""
    _, path = reference
    out = tmp_path / (value if option == "--out" else "repo")
    args = ["import-mae", str(path), "--arch", "vip-nano", "--img-size", "32", "--out", str(out)]
    extra = [] if option == "--out" else [option, value]
    assert main([*args, *extra, "--synthetic-dataset", "Shaders21k"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "vip-hub import-mae: error: repo id" in err, err
    assert not out.exists()
