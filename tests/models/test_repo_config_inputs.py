"""A repo whose ``CONFIG_FILE``, or whose text decoder's configuration, its author wrote wrong (and
bound into its ledger): each is refused by name before timm or torch builds anything (a config
by ``verify`` too), never loaded as another model nor a TypeError / RuntimeError traceback."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support.dpcap import ReferenceDPCap, import_reference, save_reference
from support.helpers import rewrite_ledger_copies

from vip_hub import load_encoder, verify_repo
from vip_hub.errors import ConfigError, RepoFormatError, TamperedFileError, VerificationError
from vip_hub.loading import load_captioner
from vip_hub.repo.artifacts import (
    digest_file,
    read_safetensors_metadata,
    rewrite_safetensors_metadata,
)
from vip_hub.repo_format import (
    CONFIG_FILE,
    TEXT_DECODER_FILE,
)


def _rebind(repo: Path) -> None:
    """Record every file's digest as it is now in the ledger's three copies, as an author
    re-exporting the changed repo would."""
    rewrite_ledger_copies(
        repo,
        lambda ledger: {
            **ledger,
            "artifacts": {rel: digest_file(repo / rel, rel) for rel in ledger["artifacts"]},
        },
    )


def _set(section: str | None, key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda c: (c[section] if section else c).__setitem__(key, value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        # 6 heads divide the width as 12 do: timm built it and it embedded otherwise, silently
        (_set("model_args", "num_heads", 6), "model_args.num_heads is 6, not 12"),
        (_set("model_args", "fc_norm", False), "model_args.fc_norm is False, not True"),
        (_set(None, "architecture", "no_such_vit"), "architecture is 'no_such_vit', not"),
        (_set(None, "num_classes", 10), "num_classes is 10, not 0"),
    ],
)
def test_a_config_timm_would_build_as_another_model_is_refused_by_name(tiny_repo, change, message):
    config = json.loads((tiny_repo / CONFIG_FILE).read_text())
    change(config)
    (tiny_repo / CONFIG_FILE).write_text(json.dumps(config))
    _rebind(tiny_repo)
    _refused(tiny_repo, RepoFormatError, f"timm would build another model .*{message}")


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (_set("model_args", "img_size", "32"), RepoFormatError, "model_args.img_size is '32'"),
        (_set("model_args", "img_size", 32.5), RepoFormatError, "model_args.img_size is 32.5"),
        (_set("model_args", "depth", [12]), RepoFormatError, r"model_args.depth is \[12\]"),
        (_set(None, "model_args", [1]), RepoFormatError, "model_args is not an object"),
        (_set("pretrained_cfg", "crop_pct", "x"), RepoFormatError, "pretrained_cfg.crop_pct is"),
        (_set("pretrained_cfg", "interpolation", "cubic"), ConfigError, "interpolation 'cubic'"),
    ],
)
def test_a_config_value_of_the_wrong_type_is_refused_by_name(tiny_repo, change, error, message):
    config = json.loads((tiny_repo / CONFIG_FILE).read_text())
    change(config)
    (tiny_repo / CONFIG_FILE).write_text(json.dumps(config))
    _rebind(tiny_repo)
    _refused(tiny_repo, error, message)


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        # a 16,384-pixel square from every image: 3.2 GB a tensor, the service out of memory
        (
            _set("pretrained_cfg", "input_size", [3, 16384, 16384]),
            RepoFormatError,
            r"pretrained_cfg.input_size is \[3, 16384, 16384\], not \[3, 32, 32\]",
        ),
        (_set("pretrained_cfg", "std", [0, 0, 0]), RepoFormatError, r"pretrained_cfg.std is"),
        (_set("pretrained_cfg", "mean", "abc"), RepoFormatError, "pretrained_cfg.mean is 'abc'"),
        (_set("pretrained_cfg", "crop_mode", "border"), RepoFormatError, "crop_mode is 'border'"),
        (
            lambda c: c["pretrained_cfg"].pop("input_size"),
            RepoFormatError,
            "pretrained_cfg.input_size is None",
        ),
        # resized to 3,200 pixels a side before its crop, every image
        (_set("pretrained_cfg", "crop_pct", 0.01), ConfigError, r"crop_pct must be in \[0.5, 1\]"),
    ],
)
def test_a_config_timm_would_transform_images_otherwise_with_is_refused(
    tiny_repo, change, error, message
):
    """The transform a served image goes through is timm's, from the repo's pretrained_cfg:
    any entry of it other than the spec's (an input size, a mean or std, a crop mode, a crop
    down to a sliver) is refused by verify and by loading, before any image is resized."""
    config = json.loads((tiny_repo / CONFIG_FILE).read_text())
    change(config)
    (tiny_repo / CONFIG_FILE).write_text(json.dumps(config))
    _rebind(tiny_repo)
    _refused(tiny_repo, error, message)


def _refused(repo: Path, error: type[Exception], message: str) -> None:
    """``verify`` fails naming ``message``, and so does loading without it, as ``error``."""
    report = verify_repo(repo)
    assert not report.ok and re.search(message, str(report.problems)), report.problems
    with pytest.raises(VerificationError, match=message):
        load_encoder(repo)
    with pytest.raises(error, match=message):
        load_encoder(repo, verify=False)


@pytest.fixture(scope="module")
def dpcap_repo(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("dpcap")
    torch.manual_seed(0)
    return import_reference(
        save_reference(ReferenceDPCap().eval(), folder / "checkpoint-4.pth"), folder
    )


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("mlp_ratio", -1.0, "mlp_ratio must be positive and finite, got -1.0"),
        ("mlp_ratio", float("nan"), "mlp_ratio must be positive and finite, got nan"),
        ("width", 96.0, "width must be an integer, got 96.0"),
        ("grid_size", 2.0, "grid_size must be an integer, got 2.0"),
    ],
)
def test_a_text_decoder_configuration_of_the_wrong_type_is_refused_by_name(
    dpcap_repo, tmp_path, key, value, message
):
    """The configuration sits in the decoder file's metadata, outside its tensors digest, and
    ``CONFIG_FILE`` binds it: ``verify`` and the verified loaders refuse a changed one (96.0 for 96
    too), and both loaders, unverified, name the value."""
    repo = Path(shutil.copytree(dpcap_repo, tmp_path / "repo"))
    meta = read_safetensors_metadata(repo / TEXT_DECODER_FILE)
    (name,) = [k for k, v in meta.items() if k != "format" and '"mlp_ratio"' in v]
    config = json.loads(meta[name])
    config[key] = value
    rewrite_safetensors_metadata(repo / TEXT_DECODER_FILE, {**meta, name: json.dumps(config)})
    problems = "; ".join(map(str, verify_repo(repo).problems))
    assert f"{TEXT_DECODER_FILE}: its metadata's configuration is not the one" in problems
    for load in (load_encoder, load_captioner):
        with pytest.raises(TamperedFileError, match="configuration is not the one"):
            load(repo)
        with pytest.raises(RepoFormatError, match=f"text decoder: {message}"):
            load(repo, verify=False)


def test_the_specs_normalisation_is_timms_and_a_config_check_imports_no_timm():
    """Every encoder normalises as timm's ImageNet default; the spec states it without importing
    timm, so that a hub without inference verifies a push without loading timm or torchvision."""
    import subprocess
    import sys

    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    from vip_hub.models.encoders import IMAGENET_MEAN, IMAGENET_STD

    assert (IMAGENET_MEAN, IMAGENET_STD) == (IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)
    config = Path(__file__).parents[2] / "training" / "priors" / "vip-nano-scatter" / CONFIG_FILE
    check = (
        "import json, sys; from vip_hub.models.encoders import EncoderSpec; "
        f"EncoderSpec.from_config(json.loads(open({str(config)!r}).read())); "
        "assert 'timm' not in sys.modules and 'torchvision' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", check], check=True, timeout=120)
