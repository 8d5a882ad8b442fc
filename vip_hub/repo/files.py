"""Writing a released-encoder repo folder, and updating one in place (the layout and every
name are in ``vip_hub.repo_format``).

Every write goes to a temporary sibling folder that replaces the target in one exchange
(``vip_hub.paths.replace_dir``), so a crash leaves the old repo or the new one, never a
half-written one nor none.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Collection, Container, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Required, TypedDict

import torch
from huggingface_hub import EvalResult
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from timm.models.vision_transformer import VisionTransformer

from ..errors import ConfigError, RepoFormatError, UnsafePathError
from ..models.encoders import EncoderSpec, count_parameters
from ..models.features import (
    SPATIAL_SYNTAX,
    SpatialMode,
    check_pooling,
    default_spatial_modes,
    feature_dim,
)
from ..models.text_decoder import Captioner, ImageMemory, TextDecoder, TextDecoderConfig
from ..models.tokenizer import CaptionTokenizer
from ..paths import fsync_dir, replace_dir, tree_path_problems, validate_relpath
from ..privacy.ledger import DPStage, NonPrivateStage, PrivacyLedger
from ..repo_format import (
    CARD_FILE,
    CONFIG_BLOCK,
    CONFIG_DECODERS,
    CONFIG_FILE,
    FORMAT_VERSION,
    LEDGER_FILE,
    MAE_DECODER_FILE,
    MANAGED_FILES,
    META_ARCH,
    META_DECODER,
    META_FORMAT,
    META_LEDGER,
    SIGNATURE_FILE,
    TEXT_DECODER_FILE,
    VOCAB_FILE,
    WEIGHTS_FILE,
)
from .artifacts import (
    bytes_sha256,
    digest_file,
    read_safetensors_metadata,
    rewrite_safetensors_metadata,
    tensors_digest_of,
)
from .card import DEFAULT_LICENSE, CardInfo, card_info, render_card
from .signing import load_signing_key, sign_repo
from .verify import is_hidden, repo_files, verify_repo

__all__ = [
    "DEFAULT_ORG",
    "Release",
    "can_caption",
    "card_repo_id",
    "check_feature_dims",
    "check_replaceable",
    "declared_spatial",
    "export_encoder",
    "load_image_memory",
    "load_text_decoder",
    "read_config",
    "text_decoder_file",
    "update_repo",
]

DEFAULT_ORG = "vip"
"""The namespace a card names when given no repo id (``card_repo_id``)."""


class Release(TypedDict, total=False):
    """What a repo records besides its weights, passed through to ``export_encoder`` by the
    checkpoint importers: ledger stages in training order, names, card fields."""

    stages: Required[Iterable[NonPrivateStage | DPStage]]
    model_name: Required[str]
    repo_id: str | None
    summary: str
    license: str
    overwrite: bool


def check_replaceable(out: Path) -> None:
    """ConfigError unless ``out`` may be replaced whole by an export: absent, an empty folder or
    an earlier export (its ledger); a folder of anything else would be deleted."""
    if not out.exists() or (
        out.is_dir() and ((out / LEDGER_FILE).is_file() or not any(out.iterdir()))
    ):
        return
    raise ConfigError(
        f"{out} exists and is not a released repo (no {LEDGER_FILE}) nor an empty folder: the "
        "export replaces it whole; give a new or empty folder"
    )


def export_encoder(
    out_dir: str | os.PathLike[str],
    model: VisionTransformer,
    spec: EncoderSpec,
    stages: Iterable[NonPrivateStage | DPStage],
    *,
    model_name: str,
    repo_id: str | None = None,
    summary: str = "",
    license: str = DEFAULT_LICENSE,
    eval_results: Iterable[EvalResult] = (),
    decoder: Mapping[str, torch.Tensor] | None = None,
    decoder_config: Mapping[str, Any] | None = None,
    text_decoder: TextDecoder | None = None,
    vocab: bytes | None = None,
    extra_files: Mapping[str, bytes] | None = None,
    spatial: Sequence[str] | None = None,
    weights_dtype: torch.dtype | None = None,
    overwrite: bool = False,
    signing_key: str | os.PathLike[str] | None = None,
) -> Path:
    """Write a released-encoder repo for ``model`` to ``out_dir`` and return its path.

    ``stages`` are the ledger's stages in training order; guarantees and file digests are
    computed here. Optional: ``decoder`` (an MAE decoder state dict, ViP), ``text_decoder`` (a
    ``vip_hub.models.text_decoder.TextDecoder``, DP-Cap: it also gives the ``dpcap`` feature mode)
    with ``vocab`` (the bytes of the tokenizer's vocabulary file), ``extra_files`` (e.g. a
    training-curve PNG), and ``spatial``: the spatial feature modes the repo declares (default
    ``default_spatial_modes(model)``; ``()`` for none); ``weights_dtype`` stores the encoder's
    floating tensors in that dtype (float16 halves a prior committed to a project);
    ``signing_key`` signs the repo before it replaces ``out_dir`` (``sign_repo``).
    """
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise ConfigError(f"{out} exists; pass overwrite=True to replace it")
    check_replaceable(out)
    if signing_key is not None:
        load_signing_key(signing_key, out)
    _check_text_parts(spec, model, text_decoder, vocab)
    tensors = _encoder_tensors(model, weights_dtype)
    memory = text_decoder.memory if text_decoder is not None else None
    text = text_decoder_file(text_decoder) if text_decoder is not None else None
    decoder_configs = {
        **({MAE_DECODER_FILE: dict(decoder_config or {})} if decoder is not None else {}),
        **({TEXT_DECODER_FILE: json.loads(text[1][META_DECODER])} if text is not None else {}),
    }
    config = _config(spec, model, memory, spatial, decoder_configs)
    config_bytes = (json.dumps(config, indent=2) + "\n").encode()
    artifacts = {WEIGHTS_FILE: tensors_digest_of(tensors), CONFIG_FILE: bytes_sha256(config_bytes)}
    dec = None
    if decoder is not None:
        dec = {k: v.detach().cpu().contiguous() for k, v in decoder.items()}
        artifacts[MAE_DECODER_FILE] = tensors_digest_of(dec)
    if text is not None:
        artifacts[TEXT_DECODER_FILE] = tensors_digest_of(text[0])
    if vocab is not None:
        artifacts[VOCAB_FILE] = bytes_sha256(vocab)
    _check_given(extra_files or {}, {*MANAGED_FILES, *artifacts})
    for rel, data in (extra_files or {}).items():
        artifacts[rel] = bytes_sha256(data)
    ledger = PrivacyLedger.build(stages, artifacts)
    info = CardInfo(
        model_name=model_name,
        repo_id=card_repo_id(model_name, repo_id),
        summary=summary,
        license=license,
        eval_results=list(eval_results),
    )

    def write(tmp: Path) -> None:
        (tmp / CONFIG_FILE).write_bytes(config_bytes)
        save_file(tensors, tmp / WEIGHTS_FILE, metadata=_weights_metadata(spec, ledger))
        if dec is not None:
            meta = {"format": "pt", META_DECODER: json.dumps(decoder_configs[MAE_DECODER_FILE])}
            save_file(dec, tmp / MAE_DECODER_FILE, metadata=meta)
        if text is not None:
            save_file(text[0], tmp / TEXT_DECODER_FILE, metadata=text[1])
        if vocab is not None:
            (tmp / VOCAB_FILE).write_bytes(vocab)
        for rel, data in (extra_files or {}).items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_bytes(data)
        _write_ledger_copies(tmp, ledger, info, config, rewrite_weights=False)
        if signing_key is not None:
            sign_repo(tmp, signing_key, out.name)

    _atomic_dir(out, write, fresh=True)
    return out


def card_repo_id(model_name: str, repo_id: str | None = None) -> str:
    """The hub id a card names (``repo_id``, else ``vip/<model_name>``) if the hub client would
    send it, else ConfigError (``vip/../../evil``, a byte the shell could not decode)."""
    repo_id = repo_id or f"{DEFAULT_ORG}/{model_name}"
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        why = " ".join(str(e).split()).encode("utf-8", "backslashreplace").decode()
        raise ConfigError(
            f"repo id {repo_id!r} (the repo id given, else vip/ and the model name, else the "
            f"output folder's name): {why}"
        ) from None
    return repo_id


def _bound_to(result: EvalResult, component: str) -> bool:
    """Whether the card ``result`` is ``component``'s: its ``metric_config`` names it, or, on a
    card written before results named theirs, its protocol quotes the head's name."""
    if result.metric_config is not None:
        return result.metric_config == component
    return f"'{component.rpartition('/')[2]}'" in (result.metric_name or "")


def update_repo(
    repo_dir: str | os.PathLike[str],
    *,
    add_stages: Iterable[NonPrivateStage | DPStage] = (),
    add_files: Mapping[str, bytes | os.PathLike[str]] | None = None,
    add_eval_results: Iterable[EvalResult] = (),
    replace_component: str | None = None,
    comparison: list[dict[str, Any]] | None = None,
    signing_key: str | os.PathLike[str] | None = None,
) -> PrivacyLedger:
    """Add stages, files and evaluation results to an existing repo (e.g. a probe head).

    ``replace_component`` (e.g. a head's folder) first drops that component's stages, the
    files under its folder and the card results bound to it (``metric_config``).
    ``comparison`` replaces the card's probe-comparison table. The three ledger copies and the
    card are rewritten together; the update is atomic. A signature no longer covers the new
    files and is removed, unless ``signing_key`` signs the updated repo before it replaces the
    old (else sign again: ``vip-hub sign``). Returns the new ledger.
    """
    repo = Path(repo_dir)
    verify_repo(repo).raise_for_problems()
    if signing_key is not None:
        load_signing_key(signing_key, repo)
    old = PrivacyLedger.read(repo)
    files = dict(add_files or {})
    dropped = f"{replace_component}/" if replace_component else None
    existing = [rel for rel in repo_files(repo) if not (dropped and rel.startswith(dropped))]
    _check_given(files, MANAGED_FILES, existing)
    config = read_config(repo)
    info = card_info((repo / CARD_FILE).read_text(encoding="utf-8"))
    new_results = list(add_eval_results)
    replaced = {(r.dataset_name, r.metric_name) for r in new_results}
    info.eval_results = [
        r
        for r in info.eval_results
        if (r.dataset_name, r.metric_name) not in replaced
        and not (replace_component and _bound_to(r, replace_component))
    ] + new_results
    if comparison is not None:
        info.comparison = list(comparison)
    result: dict[str, PrivacyLedger] = {}

    stages = [s for s in old.stages if s.component != replace_component]
    kept = {rel: d for rel, d in old.artifacts.items() if not (dropped and rel.startswith(dropped))}

    def write(tmp: Path) -> None:
        (tmp / SIGNATURE_FILE).unlink(missing_ok=True)
        if replace_component and (tmp / replace_component).is_dir():
            shutil.rmtree(tmp / replace_component)
        for rel, data in files.items():
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            _write_new(target, data if isinstance(data, bytes) else Path(data).read_bytes())
        artifacts = {**kept, **{rel: digest_file(tmp / rel, rel) for rel in files}}
        ledger = PrivacyLedger.build([*stages, *add_stages], artifacts)
        _write_ledger_copies(tmp, ledger, info, config)
        if signing_key is not None:
            sign_repo(tmp, signing_key, repo.name)
        result["ledger"] = ledger

    _atomic_dir(repo, write, fresh=False)
    return result["ledger"]


def read_config(repo_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The repo's timm configuration as a dict."""
    path = Path(repo_dir) / CONFIG_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise RepoFormatError(f"{path}: not a readable {CONFIG_FILE} ({e})") from None


# --------------------------------------------------------------------------- internals
def _encoder_tensors(
    model: VisionTransformer, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in model.state_dict().items():
        if not k.startswith("head."):
            v = v.detach().cpu()
            cast = dtype is not None and v.is_floating_point()
            out[k] = (v.to(dtype) if cast else v).contiguous()
    return out


def _check_text_parts(
    spec: EncoderSpec,
    model: VisionTransformer,
    text_decoder: TextDecoder | None,
    vocab: bytes | None,
) -> None:
    """A text decoder only where the family captions, fitting the encoder; a vocab only with it,
    fitting it."""
    if text_decoder is None:
        if vocab is not None:
            raise ConfigError("a vocabulary is only exported with the text decoder that uses it")
        return
    if not spec.family.captions:
        raise ConfigError(f"{spec.arch}: {spec.family.title} repos carry no text decoder")
    Captioner(model, text_decoder)  # checks that the decoder reads this encoder's tokens
    if vocab is not None:
        text_decoder.config.check_tokenizer(CaptionTokenizer(vocab))


def declared_spatial(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The spatial feature modes that the timm configuration's ``feature_dims`` declares, in
    its order."""
    dims = (config.get(CONFIG_BLOCK) or {}).get("feature_dims") or {}
    try:
        return tuple(m for m in dims if SpatialMode.parse(m) is not None)
    except ConfigError as e:
        raise RepoFormatError(f"{CONFIG_FILE} feature_dims: {e}") from None


def check_feature_dims(config: Mapping[str, Any], model: VisionTransformer) -> None:
    """Raise RepoFormatError unless every spatial mode the timm configuration declares fits
    ``model`` with the declared width."""
    dims = config[CONFIG_BLOCK]["feature_dims"]
    for mode in declared_spatial(config):
        try:
            width = feature_dim(model, mode)
        except ConfigError as e:
            raise RepoFormatError(f"{CONFIG_FILE} feature_dims: {e}") from None
        if dims[mode] != width:
            raise RepoFormatError(
                f"{CONFIG_FILE} feature_dims: {mode} is {width} wide, not {dims[mode]}"
            )


def _config(
    spec: EncoderSpec,
    model: VisionTransformer,
    memory: ImageMemory | None = None,
    spatial: Sequence[str] | None = None,
    decoders: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    spatial = default_spatial_modes(model) if spatial is None else tuple(spatial)
    for mode in spatial:
        if check_pooling(mode, model) is None:
            raise ConfigError(f"{mode} is not a spatial feature mode ({SPATIAL_SYNTAX})")
    modes = (*spec.family.offered_poolings(memory is not None), *dict.fromkeys(spatial))
    return {
        "architecture": spec.architecture.timm_architecture,
        "num_classes": 0,
        "num_features": model.num_features,
        "global_pool": "avg",
        "model_args": spec.model_args(),
        "pretrained_cfg": spec.pretrained_cfg(),
        CONFIG_BLOCK: {
            "format_version": FORMAT_VERSION,
            "arch": spec.arch,
            "family": spec.family.name,
            "num_params": count_parameters(model),
            "feature_dims": {p: feature_dim(model, p, memory) for p in modes},
            **({CONFIG_DECODERS: dict(decoders)} if decoders else {}),
        },
    }


def _weights_metadata(spec: EncoderSpec, ledger: PrivacyLedger) -> dict[str, str]:
    return {
        "format": "pt",
        META_FORMAT: str(FORMAT_VERSION),
        META_ARCH: spec.arch,
        META_LEDGER: ledger.to_json(),
    }


def _write_ledger_copies(
    folder: Path,
    ledger: PrivacyLedger,
    info: CardInfo,
    config: dict[str, Any],
    rewrite_weights: bool = True,
) -> None:
    if rewrite_weights:
        meta = read_safetensors_metadata(folder / WEIGHTS_FILE)
        meta[META_LEDGER] = ledger.to_json()
        rewrite_safetensors_metadata(folder / WEIGHTS_FILE, meta)
    _write_new(folder / LEDGER_FILE, ledger.to_json().encode())
    plots = sorted(p for p in ledger.artifacts if p.endswith(".png"))
    block = config[CONFIG_BLOCK]
    spec = EncoderSpec.from_config(config)
    card = render_card(
        info,
        spec,
        ledger,
        num_params=int(block["num_params"]),
        feature_dims=block["feature_dims"],
        plots=plots,
        captions=spec.family.captions and can_caption(os.listdir(folder)),
    )
    _write_new(folder / CARD_FILE, card.encode())


def _check_given(
    names: Iterable[str], reserved: Collection[str], beside: Iterable[str] = ()
) -> None:
    """Refuse a name of ``names`` (files given to write into a repo) that is unsafe or
    ``reserved`` (what vip_hub writes), or that no filesystem holds beside those and the files
    ``beside`` (``tree_path_problems``: equal but for case, a file's folder): its error names it."""
    names = list(names)
    for rel in names:
        validate_relpath(rel)
        if is_hidden(rel):
            raise UnsafePathError(
                f"{rel}: a hidden file, which verify and signatures skip: the ledger could not "
                "bind it"
            )
        if rel in reserved:
            raise ConfigError(f"{rel} is managed by vip_hub and cannot be given")
    if problems := tree_path_problems({*reserved, *beside, *names}):
        raise UnsafePathError(f"the repo cannot hold {', '.join(names)}: {'; '.join(problems)}")


def _write_new(path: Path, data: bytes) -> None:
    """Write a new inode: ``path`` may be a hard link into the repo being replaced."""
    path.unlink(missing_ok=True)
    path.write_bytes(data)


def _atomic_dir(target: Path, fill: Any, *, fresh: bool) -> None:
    """Build the new contents of ``target`` in a sibling temp dir, then swap it in (``replace_dir``:
    a crash leaves the old folder or the new one at ``target``, never neither); a ``target`` that
    is a symbolic link has the folder it points to replaced, the link kept."""
    target = target.resolve()  # a link: the folder it points to; "." or "x/..": a named folder
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        if not fresh:
            shutil.copytree(target, tmp, dirs_exist_ok=True, copy_function=os.link)
        fill(tmp)
        verify_repo(tmp).raise_for_problems()  # never swap in a repo that would not verify
        _fsync_tree(tmp)
        replace_dir(tmp, target)
        fsync_dir(target.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _fsync_tree(folder: Path) -> None:
    for root, _, names in os.walk(folder):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


# ------------------------------------------------------------------- text decoder files
def can_caption(files: Container[str]) -> bool:
    """Whether a repo with these files (repo paths) captions: its text decoder and vocabulary."""
    return TEXT_DECODER_FILE in files and VOCAB_FILE in files


def text_decoder_file(decoder: TextDecoder) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and safetensors metadata of the text decoder's weights file for ``decoder``."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in decoder.state_dict().items()}
    return tensors, {"format": "pt", META_DECODER: json.dumps(decoder.config.to_dict())}


def read_decoder_config(path: str | os.PathLike[str]) -> TextDecoderConfig:
    """The ``TextDecoderConfig`` kept in a text decoder file's metadata."""
    meta = read_safetensors_metadata(path)
    try:
        return TextDecoderConfig.from_dict(json.loads(meta[META_DECODER]))
    except (KeyError, ValueError, ConfigError) as e:
        raise RepoFormatError(
            f"{path}: no valid text decoder configuration in its metadata ({e})"
        ) from None


def load_text_decoder(
    path: str | os.PathLike[str], device: str | torch.device = "cpu"
) -> TextDecoder:
    """A text decoder (eval mode) from its safetensors file."""
    decoder = TextDecoder(read_decoder_config(path))
    try:
        decoder.load_state_dict(load_file(path), strict=True)
    except RuntimeError as e:
        raise RepoFormatError(
            f"{path}: tensors do not fit its configuration ({' '.join(str(e).split())})"
        ) from None
    return decoder.eval().to(device)


def load_image_memory(
    path: str | os.PathLike[str], device: str | torch.device = "cpu"
) -> ImageMemory:
    """Only the image-memory weights of a text decoder file (what the ``dpcap`` features need)."""
    c = read_decoder_config(path)
    memory = ImageMemory(c.image_dim, c.width, c.num_image_tokens)
    prefix = "memory."
    with safe_open(path, framework="pt") as f:
        state = {k.removeprefix(prefix): f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
    try:
        memory.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise RepoFormatError(
            f"{path}: image-memory tensors do not fit its configuration "
            f"({' '.join(str(e).split())})"
        ) from None
    return memory.eval().to(device)
