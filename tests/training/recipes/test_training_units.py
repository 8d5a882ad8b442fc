"""Training units: procedural images, MAE, per-example clipping, sampling, noise, budget."""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import subprocess
import sys

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from support.clipping import TokenModel
from support.helpers import DEVICES, import_nano, swap_after_verify, synthetic_stage
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from training.data.images import mae_transform
from training.data.procedural import FAMILIES, SyntheticImages, contact_sheet, render
from training.dp.clipping import PerExampleClipper, _materialise
from training.dp.sampling import micro_batches, poisson_sample, rank_share
from training.main_job import MainJobConfig
from training.recipes.mae import (
    MAE,
    DecoderConfig,
    load_mae,
    masked_loss,
    patchify,
    warm_decoder,
)
from training.recipes.probe import ProbeConfig
from training.recipes.vip import VipConfig
from training.skeleton.config import DPRunConfig, RunConfig, add_config_args, config_from_args
from training.skeleton.distributed import Dist
from training.skeleton.run import Run
from training.skeleton.runlog import RunLog
from vip_hub import export_encoder
from vip_hub.errors import (
    CheckpointError,
    ConfigError,
    RepoFormatError,
    TamperedFileError,
    UnsupportedLayerError,
)
from vip_hub.models.encoders import EncoderSpec, create_encoder, mae_decoder_shapes
from vip_hub.privacy.audit import MAX_CANARIES
from vip_hub.repo_format import LEDGER_FILE, MAE_DECODER_FILE, META_DECODER

SPEC = EncoderSpec("vip-nano", img_size=32, patch_size=8)
SMALL_DECODER = DecoderConfig(dim=64, depth=1, num_heads=4)


def small_mae(dtype: torch.dtype = torch.float32, seed: int = 0, device: str = "cpu") -> MAE:
    torch.manual_seed(seed)
    return MAE(create_encoder(SPEC, mae_init=True), SMALL_DECODER).to(device, dtype)


# ---------------------------------------------------------------- procedural images
def test_synthetic_images_are_deterministic_per_seed_and_index() -> None:
    a, b = render(3, 17, 48), render(3, 17, 48)
    assert a.shape == (48, 48, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b)
    assert not np.array_equal(a, render(3, 18, 48))
    assert not np.array_equal(a, render(4, 17, 48))


@pytest.mark.parametrize("size", [16, 33, 128])
def test_synthetic_images_at_any_resolution(size: int) -> None:
    img = render(0, 5, size)
    assert img.shape == (size, size, 3)


def test_every_family_draws_varied_images() -> None:
    rng = np.random.default_rng(0)
    grid = np.meshgrid(np.arange(32) / 32, np.arange(32) / 32)
    for name, family in FAMILIES.items():
        field = family(rng, (grid[0], grid[1]))
        assert field.shape == (32, 32), name
        assert 0 <= field.min() and field.max() <= 1 and field.std() > 0.01, name


def test_families_restrict_the_programs() -> None:
    """A stream restricted to some families differs from the full stream and stays
    deterministic; an unknown family is named."""
    some = ("dead_leaves", "cellular")
    a = render(0, 3, 32, some)
    assert np.array_equal(a, render(0, 3, 32, some))
    assert any(not np.array_equal(render(0, i, 32, some), render(0, i, 32)) for i in range(8))
    with pytest.raises(ConfigError, match="stripes"):
        render(0, 0, 32, ("stripes",))


def test_synthetic_dataset_and_contact_sheet() -> None:
    data = SyntheticImages(32, seed=1)
    x = data[7]
    assert x.shape == (3, 32, 32) and torch.isfinite(x).all()
    assert torch.equal(x, SyntheticImages(32, seed=1)[7])
    sheet = contact_sheet(seed=0, count=6, size=24, columns=3)
    assert sheet.size == (3 * 28 + 4, 2 * 28 + 4)


# ---------------------------------------------------------------- MAE
def test_mae_loss_is_per_example_and_masks_the_ratio() -> None:
    mae = small_mae()
    x = torch.randn(3, 3, 32, 32)
    noise = torch.rand(3, 16)
    losses = mae(x, noise)
    assert losses.shape == (3,)
    # Example 0's loss does not depend on the other examples.
    assert torch.allclose(mae(x[:1], noise[:1]), losses[:1], atol=1e-6)
    assert mae.num_masked() == 12
    assert patchify(x, 8).shape == (3, 16, 8 * 8 * 3)


def test_mae_decoder_keys_follow_the_reference() -> None:
    keys = set(small_mae().decoder_state_dict())
    for k in (
        "mask_token",
        "decoder_pos_embed",
        "decoder_embed.weight",
        "decoder_blocks.0.attn.qkv.weight",
        "decoder_norm.weight",
        "decoder_pred.weight",
    ):
        assert k in keys
    assert not any(k.startswith("encoder.") for k in keys)


def test_the_mae_decoder_rule_is_the_modules_shapes() -> None:
    """``mae_decoder_shapes``, the rule the importer and ``load_mae`` hold a decoder to, names
    every tensor of the MAE's decoder with its shape."""
    shapes = {k: tuple(v.shape) for k, v in small_mae().decoder_state_dict().items()}
    assert mae_decoder_shapes(SPEC, SMALL_DECODER.dim, SMALL_DECODER.depth) == shapes


def test_load_mae_reads_an_imported_decoder_and_names_a_wrong_one(tmp_path) -> None:
    """A ViP reference checkpoint (an MAE's tensors, its final norm named ``norm``) imports into a
    repo whose MAE ``load_mae`` builds with the decoder as it was; a decoder file of another
    shape is a RepoFormatError naming the tensor, not torch's size mismatch."""
    spec = EncoderSpec("vip-nano", img_size=32)
    torch.manual_seed(5)
    mae = MAE(create_encoder(spec, mae_init=True), SMALL_DECODER)
    encoder = {k.replace("fc_norm.", "norm."): v for k, v in mae.encoder.state_dict().items()}
    torch.save({"model": encoder | mae.decoder_state_dict()}, tmp_path / "ref.pth")
    repo = import_nano(tmp_path / "ref.pth", tmp_path / "repo", name="imported")
    loaded, _ = load_mae(repo)
    assert (loaded.config.dim, loaded.config.depth) == (64, 1)
    for key, value in mae.decoder_state_dict().items():
        assert torch.equal(loaded.decoder_state_dict()[key], value), key

    wrong = mae.decoder_state_dict() | {"decoder_pred.weight": torch.zeros(768, 32)}
    odd = export_encoder(
        tmp_path / "odd",
        mae.encoder,
        spec,
        [synthetic_stage()],
        model_name="odd",
        decoder=wrong,
        decoder_config=SMALL_DECODER.to_dict(),
    )
    with pytest.raises(
        RepoFormatError, match=r"decoder_pred\.weight \(768, 32\) \(expected \(768, 64\)\)"
    ):
        load_mae(odd)


def test_load_mae_refuses_a_decoder_replaced_after_verification(tmp_path, monkeypatch) -> None:
    """The MAE decoder ``load_mae`` reads after the repo verified must be the one the verified
    ledger and configuration bind: a decoder file swapped in between (same names and shapes,
    other values; or other heads in its metadata) is a TamperedFileError naming it."""
    torch.manual_seed(6)
    mae = MAE(create_encoder(SPEC, mae_init=True), SMALL_DECODER)
    repo = export_encoder(
        tmp_path / "repo", mae.encoder, SPEC, [synthetic_stage()], model_name="swapped",
        decoder=mae.decoder_state_dict(), decoder_config=SMALL_DECODER.to_dict(),
    )  # fmt: skip
    original = (repo / MAE_DECODER_FILE).read_bytes()
    with monkeypatch.context() as m:
        swap_after_verify(m, repo / MAE_DECODER_FILE)
        with pytest.raises(TamperedFileError, match=f"{MAE_DECODER_FILE}: changed after verif"):
            load_mae(repo)
    (repo / MAE_DECODER_FILE).write_bytes(original)
    # its configuration, which the digest leaves out: the same tensors read with other heads
    other = json.dumps({**SMALL_DECODER.to_dict(), "num_heads": 1})
    swap_after_verify(
        monkeypatch, repo / MAE_DECODER_FILE, lambda t: t, lambda m: {**m, META_DECODER: other}
    )
    with pytest.raises(
        TamperedFileError,
        match=f"{MAE_DECODER_FILE}: changed after verification: its configuration",
    ):
        load_mae(repo)


def test_the_decoder_warm_up_trains_the_decoder_alone_on_public_images_and_repeats() -> None:
    """``warm_decoder`` (the ViP stage's public warm-up) moves the decoder, leaves every encoder
    tensor bitwise as it was and every parameter's trainable flag as it found it, and is a
    function of its seed alone: two warm-ups of one MAE give the same decoder, whatever torch's
    global generator held."""
    transform = mae_transform(small_mae().encoder, SPEC.img_size)
    runs = []
    for seed in (1, 2):
        mae = small_mae()
        flags = [p.requires_grad for p in mae.parameters()]
        encoder = {k: v.clone() for k, v in mae.encoder.state_dict().items()}
        decoder = {k: v.clone() for k, v in mae.decoder_state_dict().items()}
        torch.manual_seed(seed)  # the caller's generator: not what the warm-up draws from
        losses = warm_decoder(mae, mae.encoder, transform, masked_loss(mae), 3, batch_size=4)
        assert len(losses) == 3 and all(np.isfinite(losses))
        assert all(torch.equal(encoder[k], v) for k, v in mae.encoder.state_dict().items())
        assert not torch.equal(decoder["decoder_pred.weight"], mae.decoder_pred.weight)
        assert [p.requires_grad for p in mae.parameters()] == flags
        assert all(p.grad is None for p in mae.parameters())
        runs.append(mae.decoder_state_dict())
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


# ---------------------------------------------------------------- clipping
def clipping_case(
    model: str, dtype: torch.dtype, device: str, b: int = 6, seed: int = 1
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A model and a batch for the clipping tests: the small MAE, or TokenModel on ``tokens``."""
    if model == "mae":
        mae = small_mae(dtype, device=device)
        torch.manual_seed(seed)
        return mae, (
            torch.randn(b, 3, 32, 32, dtype=dtype).to(device),
            torch.rand(b, 16, dtype=dtype).to(device),
        )
    tokens = int(model.removeprefix("tokens"))
    torch.manual_seed(0)
    net = TokenModel().to(device, dtype)
    torch.manual_seed(seed)
    return net, (
        torch.randint(0, 13, (b, tokens)).to(device),
        torch.randn(b, tokens, 4, dtype=dtype).to(device),
    )


def naive_clipped_sum(
    model: nn.Module, c: float, *inputs: torch.Tensor, factors: torch.Tensor | None = None
):
    """Example by example: each gradient from its own backward pass, clipped (by ``factors``
    when given), summed."""
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters() if p.requires_grad}
    norms = []
    for i in range(len(inputs[0])):
        model.zero_grad(set_to_none=True)
        model(*(x[i : i + 1] for x in inputs)).sum().backward()
        grads = {
            n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            for n, p in model.named_parameters()
            if p.requires_grad
        }
        norm = torch.sqrt(sum(g.double().square().sum() for g in grads.values()))
        norms.append(norm)
        factor = min(1.0, c / (float(norm) + 1e-6)) if factors is None else float(factors[i])
        for n in total:
            total[n] += grads[n] * factor
    model.zero_grad(set_to_none=True)
    return total, torch.stack(norms)


def clipped_grads(net: nn.Module, clipper: PerExampleClipper) -> dict[str, torch.Tensor]:
    """The clipper's taken fp64 sum, per trainable parameter's name."""
    names = [n for n, p in net.named_parameters() if p.requires_grad]
    return dict(zip(names, clipper.sum.views(clipper.take_sum()), strict=True))


@pytest.fixture
def exact_cuda_matmuls():
    """Plain fp32 on CUDA (no TF32 in matmuls or cuDNN convolutions) for the equivalence tests."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def relative_error(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    num = torch.sqrt(sum((got[n].double() - expected[n].double()).square().sum() for n in got))
    den = torch.sqrt(sum(expected[n].double().square().sum() for n in got))
    return float(num / den)


def test_token_model_exercises_every_linear_route() -> None:
    # the ghost norm in 2 and 3 strips of tokens, and materialised per-example products
    assert not _materialise(100, 320, 320) and not _materialise(150, 320, 320)
    assert _materialise(100, 320, 4) and _materialise(150, 320, 4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype,tol,margin",
    # the norm bounds' margin: 2^-30 in fp64; in fp32 the ghost norms' fp32 Grams add eta X^2
    # (issue 52; measured up to 0.2 % of the norm on the token model's random tokens)
    [(torch.float32, 1e-5, 5e-3), (torch.float64, 1e-12, 1e-8)],
)
@pytest.mark.parametrize("model", ["mae", "tokens100", "tokens150"])
def test_clipped_sum_equals_the_naive_per_example_computation(
    model: str, dtype: torch.dtype, tol: float, margin: float, device: str, exact_cuda_matmuls: None
) -> None:
    """Each example's norm bound sits at or above its own backward's norm, within the proof's
    margin, and the clipped sum is each example's own gradient times the factor applied."""
    net, inputs = clipping_case(model, dtype, device)
    _, norms = naive_clipped_sum(net, 1.0, *inputs)
    c = float(norms.median())  # some examples are clipped, some are not
    clipper = PerExampleClipper(net, c)
    result = clipper.accumulate(*inputs)
    ratio = result.norms.double() / norms
    assert bool((ratio >= 1 - tol * 10).all() and (ratio <= 1 + margin).all()), ratio
    assert (result.factors < 1).any() and (result.factors == 1).any()
    expected, _ = naive_clipped_sum(net, c, *inputs, factors=result.factors)
    got = clipped_grads(net, clipper)
    assert set(got) == set(expected)  # cls_token and mask_token included, nothing skipped
    assert relative_error(got, expected) < tol
    for n in got:  # and layer by layer
        assert torch.allclose(
            got[n].double(),
            expected[n].double(),
            rtol=tol * 100,
            atol=tol * float(expected[n].abs().max()),
        ), n


@pytest.mark.parametrize("device", DEVICES)
def test_clipped_sum_under_bf16_autocast_is_close_to_fp32(device: str) -> None:
    """Training on GPU runs under bf16 autocast; norms and sums must stay within bf16 rounding."""
    mae = small_mae(device=device)
    torch.manual_seed(2)
    x, noise = torch.randn(8, 3, 32, 32, device=device), torch.rand(8, 16, device=device)
    expected, norms = naive_clipped_sum(mae, float("inf"), x, noise)
    c = float(norms.median())
    expected, _ = naive_clipped_sum(mae, c, x, noise)
    clipper = PerExampleClipper(mae, c)
    with torch.autocast(device, dtype=torch.bfloat16):
        result = clipper.accumulate(x, noise)
    assert result.norms.dtype == torch.float64
    assert torch.allclose(result.norms, norms, rtol=2e-2)
    got = clipped_grads(mae, clipper)
    assert all(g.dtype == torch.float64 for g in got.values())
    assert relative_error(got, expected) < 3e-2


@pytest.mark.parametrize("device", DEVICES)
def test_no_example_contributes_more_than_c_under_bf16_autocast(device: str) -> None:
    """The layers run in bf16, whose rounding once lifted contributions up to ~1e-3 above C: each
    example's contribution (the whole sum, for a batch of one) stays <= C."""
    mae, c = small_mae(device=device), 1e-3  # every example is clipped (its norm is ~1)
    contributions = []
    for seed in range(16):
        torch.manual_seed(seed)
        x, noise = torch.randn(1, 3, 32, 32, device=device), torch.rand(1, 16, device=device)
        clipper = PerExampleClipper(mae, c)
        with torch.autocast(device, dtype=torch.bfloat16):
            assert clipper.accumulate(x, noise).factors[0] < 1
        contributions.append(float(clipper.take_sum().norm()))
    assert max(contributions) <= c
    assert min(contributions) > 0.97 * c  # and the margin that guarantees it is small


def test_clipped_sum_does_not_depend_on_the_micro_batch_split() -> None:
    mae = small_mae(torch.float64)
    x, noise = (
        torch.randn(7, 3, 32, 32, dtype=torch.float64),
        torch.rand(7, 16, dtype=torch.float64),
    )
    clipper = PerExampleClipper(mae, 0.5)
    clipper.accumulate(x, noise)
    whole = clipper.take_sum()
    for part in micro_batches(np.arange(7), 3):
        clipper.accumulate(x[part], noise[part])
    assert torch.allclose(whole, clipper.take_sum(), rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("model", ["mae", "tokens150"])
def test_clipping_bounds_every_example_and_drops_non_finite_ones(model: str) -> None:
    net, inputs = clipping_case(model, torch.float32, "cpu", b=4)
    next(x for x in inputs if x.is_floating_point()).view(4, -1)[2, 0] = float(
        "nan"
    )  # images or targets
    clipper = PerExampleClipper(net, 1e-3)
    r = clipper.accumulate(*inputs)
    assert r.factors[2] == 0 and not torch.isfinite(r.norms[2])
    total = clipper.take_sum()
    assert bool(torch.isfinite(total).all())
    assert total.norm() <= 3 * 1e-3  # three finite examples, each clipped to C


def test_parameters_without_a_rule_are_refused_not_silently_slow() -> None:
    enc = VisionTransformer(
        img_size=32,
        patch_size=8,
        embed_dim=64,
        depth=1,
        num_heads=4,
        num_classes=0,
        init_values=1e-5,
    )  # LayerScale holds a bare parameter
    with pytest.raises(UnsupportedLayerError, match="LayerScale"):
        PerExampleClipper(MAE(enc, SMALL_DECODER), 1.0)
    for option in ({"max_norm": 1.0}, {"scale_grad_by_freq": True}, {"sparse": True}):
        with pytest.raises(UnsupportedLayerError, match="Embedding"):
            PerExampleClipper(nn.Embedding(5, 3, **option), 1.0)
    with pytest.raises(ValueError, match="positive"):
        PerExampleClipper(small_mae(), 0.0)


class _HalfBroadcast(nn.Linear):
    """A layer that announces its bias as broadcast: a rule for the layer would count the bias
    again beside the broadcast rule's share, and a norm could come out up to sqrt(2) too small."""

    def broadcast_parameters(self) -> list[nn.Parameter]:
        return [self.bias]


def test_a_layer_partly_covered_elsewhere_is_refused_by_every_clipper() -> None:
    from training.dp.pair_clipping import PairClipper
    from vip_hub.errors import ConfigError

    for make in (lambda m: PerExampleClipper(m, 1.0), lambda m: PairClipper(m, 1.0, 0.5)):
        with pytest.raises(UnsupportedLayerError, match="broadcast or shared"):
            make(_HalfBroadcast(3, 2))
        with pytest.raises(ConfigError, match="no trainable parameters"):
            make(nn.Linear(3, 2).requires_grad_(False))


# ---------------------------------------------------------------- sampling
def test_poisson_sampling_rate_determinism_and_rank_streams() -> None:
    n, q = 2000, 0.05
    counts = [len(poisson_sample(n, q, seed=0, step=s)) for s in range(400)]
    assert abs(np.mean(counts) - q * n) < 1.5  # 100 expected; std of the mean ~0.5
    assert abs(np.var(counts) - n * q * (1 - q)) < 30
    s = poisson_sample(n, q, seed=0, step=3)
    assert np.array_equal(s, poisson_sample(n, q, seed=0, step=3))
    assert len(set(s)) == len(s) and s.min() >= 0 and s.max() < n
    assert not np.array_equal(s, poisson_sample(n, q, seed=0, step=3, rank=1))
    hits = np.zeros(n)
    for step in range(400):
        hits[poisson_sample(n, q, seed=1, step=step)] += 1
    assert abs(hits.mean() / 400 - q) < 0.002 and hits.std() / 400 < 0.02  # every index, same rate
    assert len(poisson_sample(5, 1e-6, seed=0, step=0)) == 0


def test_rank_shards_partition_the_dataset_and_micro_batches_cover_the_sample() -> None:
    shares = [rank_share(np.arange(11), r, 3) for r in range(3)]
    assert sorted(np.concatenate(shares).tolist()) == list(range(11))
    parts = micro_batches(np.arange(10), 4)
    assert [len(p) for p in parts] == [4, 4, 2]
    empty = micro_batches(np.zeros(0, dtype=int), 4)
    assert len(empty) == 1 and len(empty[0]) == 0


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_a_cuda_run_autocasts_to_bf16_unless_its_bf16_setting_is_off(tmp_path) -> None:
    """``bf16`` (a run setting, so a checkpoint resumes only under the same one) decides a CUDA
    run's autocast; the committed priors turn it off to train in fp32 on any device."""
    cuda = Dist(device=torch.device("cuda"))
    on = Run(RunConfig(out=str(tmp_path / "on")), cuda).autocast()
    assert isinstance(on, torch.autocast) and on.fast_dtype == torch.bfloat16
    off = RunConfig(out=str(tmp_path / "off"), bf16=False)
    assert isinstance(Run(off, cuda).autocast(), contextlib.nullcontext)
    assert off.run_settings()["bf16"] is False
    assert isinstance(
        Run(RunConfig(out=str(tmp_path / "cpu")), Dist()).autocast(), contextlib.nullcontext
    )


_REFAULTS = """
import resource, sys, torch
from training.skeleton.memory import reuse_freed_memory
applied = reuse_freed_memory() if sys.argv[1] == "reuse" else None
x, g = torch.ones(8_000, 2_048), torch.Generator().manual_seed(0)
for step in range(30):  # a DP head's steps: a Poisson-sized gather, its fp64 copy, a product
    if step == 10:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    size = int(torch.randint(3_500, 4_500, (1,), generator=g))
    batch = x[torch.randint(0, 8_000, (size,), generator=g)].double()
    (batch * 2).sum()
    del batch
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_reuse_freed_memory_stops_each_steps_tensors_from_faulting_their_pages_in_again():
    """Under glibc's defaults every step's 140-185 MiB of fresh tensors are unmapped on free and
    faulted in again next step (about 40,000 pages a step); after ``reuse_freed_memory`` the
    steps reuse the freed blocks."""
    faults = {}
    for how in ("default", "reuse"):
        out = subprocess.run(
            [sys.executable, "-c", _REFAULTS, how], capture_output=True, text=True, check=True
        ).stdout.split()
        faults[how] = int(out[1])
        if how == "reuse":
            assert out[0] == "True"
    per_step = 4_000 * 2_048 * (4 + 8 + 8) // resource.getpagesize()
    assert faults["default"] > 20 * per_step / 2
    assert faults["reuse"] < faults["default"] / 10


def test_every_command_formats_its_help_and_a_percent_sign_stays_literal() -> None:
    """argparse %-formats each option's help: a config field's description with a literal '%'
    (a recipe's, once) must neither break ``--help`` nor vanish from it; ``benchmarks/utility.py``
    takes the study's descriptions through the same ``field_help``."""
    import argparse

    from pydantic import Field

    from training.skeleton.config import add_config_args
    from vip_hub.cli.main import build_parser

    parser = build_parser()
    assert parser.epilog is None  # no plugin failed to load (it would be named there instead)
    commands = parser._subparsers._group_actions[0].choices
    assert {"train-vip", "train-dpcap", "train-logit-dp", "train-finetune"} <= commands.keys()
    for name, command in commands.items():
        assert command.format_help(), name

    class Percent(RunConfig):
        share: float = Field(0.5, description="about 1 % of the coordinates")

    percent = argparse.ArgumentParser()
    add_config_args(percent, Percent)
    assert "about 1 % of the coordinates" in percent.format_help()


@pytest.mark.parametrize("config", [DPRunConfig, MainJobConfig])
def test_more_canaries_than_a_ledger_may_record_are_refused_before_training(config):
    """A run asking for more canaries than ``Audit`` records would fail at its export, after
    training: the option refuses them up front."""
    with pytest.raises(ValidationError) as e:
        config(audit_canaries=MAX_CANARIES + 1)
    assert ("audit_canaries",) in [err["loc"] for err in e.value.errors()]


def test_a_run_refuses_an_out_folder_that_holds_something_other_than_a_released_repo(
    tmp_path,
) -> None:
    """The export replaces ``--out`` whole: a folder of other files (the private data itself,
    say) would be deleted after training, so it is refused before the run starts; an empty folder
    or an earlier export (its ledger) is written over as before."""
    other = tmp_path / "photos"
    (other / "cats").mkdir(parents=True)
    (other / "cats" / "notes.txt").write_text("precious")
    with pytest.raises(ConfigError, match="photos exists and is not a released repo"):
        Run(RunConfig(out=str(other)), Dist())
    assert (other / "cats" / "notes.txt").read_text() == "precious"
    assert not (tmp_path / "photos.run").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a released repo"):
        Run(RunConfig(out=str(tmp_path / "file")), Dist())
    (tmp_path / "empty").mkdir()
    Run(RunConfig(out=str(tmp_path / "empty")), Dist())
    (tmp_path / "earlier").mkdir()
    (tmp_path / "earlier" / LEDGER_FILE).write_text("{}")
    Run(RunConfig(out=str(tmp_path / "earlier")), Dist())


def test_damaged_files_of_a_run_folder_are_named_not_tracebacks(tmp_path) -> None:
    """A run folder's settings or run id that is not what the run wrote (not UTF-8, not JSON, not
    an object) is a CheckpointError naming the file and ``--restart`` (each was a traceback); a
    log line that is no JSON object is skipped, as a torn last line is."""
    cfg = RunConfig(out=str(tmp_path / "repo"), seed=None)
    folder = Run(cfg, Dist()).dir
    for damaged in (b"\xff", b"[1]", b"{"):
        (folder / "settings.json").write_bytes(damaged)
        with pytest.raises(
            CheckpointError, match=r"settings\.json holds no run's settings.*--restart"
        ):
            Run(cfg, Dist()).resume({})
    (folder / "settings.json").unlink()
    (folder / "run_id").write_bytes(b"\xff")
    with pytest.raises(CheckpointError, match="run_id holds no run id.*--restart"):
        Run(cfg, Dist()).run_id()
    log = tmp_path / "log.jsonl"
    log.write_bytes(b'\xff\n5\n{"step": 1}\n[2]\n{"step": 9}\n')
    kept = RunLog(log, resume_step=5)
    assert kept.records() == [{"step": 1}]
    kept.close()


@pytest.mark.parametrize("seed", [-1, 2**128])
def test_a_seed_outside_the_streams_keys_is_refused_before_the_run_folder(tmp_path, seed) -> None:
    """``--seed -1`` was refused by the noise streams once the run folder and its lock existed,
    leaving them behind; the settings refuse it, naming the option."""
    args = argparse.Namespace(out=str(tmp_path / "repo"), seed=seed)
    with pytest.raises(ConfigError, match="--seed: "):
        config_from_args(RunConfig, args)


@pytest.mark.parametrize("out", ["", ".", "/"])
def test_an_out_that_names_no_folder_is_refused_naming_it(out) -> None:
    """``--out ''`` was a ValueError traceback from naming its run folder (``OUT.run``)."""
    with pytest.raises(ConfigError, match="--out: .* names no folder"):
        config_from_args(RunConfig, argparse.Namespace(out=out))


@pytest.mark.parametrize(
    "given", [{"out": "runs/my run"}, {"out": "runs/x", "model_name": "../../evil"}]
)
def test_a_repo_id_the_hub_client_would_not_send_is_refused_before_training(given) -> None:
    """The export refuses a card's repo id the hub client would not send (``vip/my run``): that
    was found once the training was done; the settings refuse it first."""
    with pytest.raises(ConfigError, match=r"repo id 'vip/.*name\): Repo id must"):
        config_from_args(RunConfig, argparse.Namespace(**given))


def test_a_default_the_help_states_in_words_is_stated_once() -> None:
    """A field whose description gives its default in words (``--seed``: a secret random one)
    was followed by ``(default: None)`` as well."""
    parser = argparse.ArgumentParser()
    add_config_args(parser, VipConfig)
    text = " ".join(parser.format_help().split())
    assert "seed of every random stream (default: a secret random one) --" in text
    assert "(default: steps // 20) (default" not in text


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path) -> None:
    """``--config`` names a TOML file; one in another encoding is named, not a traceback."""
    path = tmp_path / "run.toml"
    path.write_bytes(b'out = "caf\xe9"\n')
    with pytest.raises(ConfigError, match="run.toml"):
        config_from_args(RunConfig, argparse.Namespace(config=path))


@pytest.mark.parametrize("cls", [VipConfig, ProbeConfig])
def test_an_unknown_device_is_refused_as_the_settings_are_read(cls) -> None:
    """``--device gpu`` was taken, and failed only when the run began (after a probe's data was
    read); every run's and head's device is checked as its settings are, naming the option."""
    args = dict(init="x", encoder="x", data="y", out="z", dataset_name="test/images", device="gpu")
    fields = {k: v for k, v in args.items() if k in cls.model_fields}
    with pytest.raises(ConfigError, match="--device: .*unknown device 'gpu'"):
        config_from_args(cls, argparse.Namespace(**fields))


@pytest.mark.parametrize("option", ["max_grad_norm", "lr", "weight_decay", "sigma", "epsilon"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_a_dp_setting_that_is_not_a_finite_number_is_refused_naming_it(
    option: str, value: float
) -> None:
    """``--max-grad-norm inf`` trained every step and then failed at the export (the ledger holds
    no infinite clip bound); ``--lr inf`` or ``--weight-decay inf`` trained and released NaN
    weights: every non-finite setting is a ConfigError naming its option before the run."""
    args = dict(init="x", data="y", out="z", dataset_name="test/images", **{option: value})
    with pytest.raises(ConfigError, match=f"--{option.replace('_', '-')}: "):
        config_from_args(VipConfig, argparse.Namespace(**args))


@pytest.mark.parametrize(
    ("command", "option"),
    [
        ("train-vip", "max-grad-norm"),
        ("train-dpcap", "max-grad-norm"),
        ("train-logit-dp", "max-grad-norm"),
        ("train-finetune", "probe-max-grad-norm"),
        ("probe", "max-grad-norm"),
    ],
)
def test_a_clipping_norm_below_what_the_clippers_take_is_refused_naming_it(
    command: str, option: str
) -> None:
    """``--max-grad-norm 1e-300`` passed ``gt=0`` and was a ``ValueError`` traceback from the
    clipper after the private data was read: the option refuses what the clippers refuse."""
    from training.commands import recipe
    from vip_hub.cli.main import build_parser

    required = {"train-dpcap": ["--vocab=v"], "probe": ["--encoder=e"]}.get(command, ["--init=i"])
    argv = [
        command,
        "--data=d",
        "--out=o",
        "--dataset-name=test/d",
        *required,
        f"--{option}=1e-300",
    ]
    args = build_parser().parse_args(argv)
    config = ProbeConfig if command == "probe" else recipe(args.recipe).config
    with pytest.raises(ConfigError, match=f"--{option}: .*greater than or equal"):
        config_from_args(config, args)


def test_an_audit_of_one_canary_is_refused_before_training() -> None:
    """One canary has no even guess count (its ledger's audit would be refused once the training
    is done): refused with the options; 0 (no audit) and 2 are taken."""
    base = {"init": "i", "data": "d", "out": "o", "dataset_name": "test/d"}
    with pytest.raises(ValidationError, match="one canary leaves no guess"):
        VipConfig(**base, audit_canaries=1)
    assert [VipConfig(**base, audit_canaries=m).audit_canaries for m in (0, 2)] == [0, 2]


def test_an_out_folder_inside_the_private_data_is_refused(tmp_path) -> None:
    """``--out`` under ``--data`` wrote the release and its run folder (secret seed included)
    among the private examples, and the next run on ``--data`` counted the release's curve PNG
    as one (its ledger's n off by one): refused, naming both."""
    data = tmp_path / "private"
    for out in (data / "release", data / "class0" / ".." / "release"):
        with pytest.raises(ValidationError, match="--out .* is inside --data"):
            VipConfig(init="i", data=str(data), out=str(out), dataset_name="test/d")
    VipConfig(init="i", data=str(data), out=str(tmp_path / "private2"), dataset_name="test/d")
    args = {"init": "i", "data": str(data), "out": str(data / "r"), "dataset_name": "test/d"}
    with pytest.raises(ConfigError) as refused:  # as the command line says it: one plain line
        config_from_args(VipConfig, argparse.Namespace(**args))
    assert str(refused.value).startswith(f"invalid settings: --out {data / 'r'} is inside")
    # a probe's repo too (its --out, else the encoder folder it adds the head to)
    from training.recipes.probe import ProbeConfig

    inside = data / "enc"
    inside.mkdir(parents=True)
    for kwargs in ({"encoder": "vip/x", "out": str(data / "r")}, {"encoder": str(inside)}):
        with pytest.raises(ValidationError, match="is inside --data"):
            ProbeConfig(data=str(data), dataset_name="test/d", **kwargs)
    ProbeConfig(data=str(data), dataset_name="test/d", encoder="vip/x")  # a hub id: no folder


def test_private_data_inside_the_out_folder_or_its_run_folder_is_refused(tmp_path) -> None:
    """``--data W/cats.run`` with ``--out W/cats`` was taken: the run wrote its lock into the data
    folder, and --restart deleted the folder with every private image in it; ``--data`` inside
    an earlier export at ``--out`` was deleted by the export, which replaces ``--out`` whole."""
    for out, data in (
        (tmp_path / "cats", tmp_path / "cats.run"),
        (tmp_path / "cats", tmp_path / "cats.run" / "images"),
        (tmp_path / "repo", tmp_path / "repo" / "private"),
    ):
        with pytest.raises(ValidationError, match="is inside --out .* or its run folder"):
            VipConfig(init="i", data=str(data), out=str(out), dataset_name="test/d")
    VipConfig(
        init="i",
        data=str(tmp_path / "cats.runs"),
        out=str(tmp_path / "cats"),
        dataset_name="test/d",
    )


def test_a_probe_out_overlapping_the_encoder_folder_is_refused(tmp_path) -> None:
    """A probe's ``--out`` inside the encoder folder: the copy with the head was written into
    the encoder's repo, which then no longer verified (files its ledger does not list)."""
    from training.recipes.probe import ProbeConfig

    data, encoder = tmp_path / "x" / "data", tmp_path / "y" / "enc"
    encoder.mkdir(parents=True)
    named = {"data": str(data), "dataset_name": "test/d", "encoder": str(encoder)}
    for out in (encoder / "with-head", tmp_path / "y"):
        with pytest.raises(ValidationError, match="and the encoder folder .* overlap"):
            ProbeConfig(**named, out=str(out))
    for out in (encoder, tmp_path / "y" / "apart"):  # the folder itself, or one apart
        ProbeConfig(**named, out=str(out))


def test_an_out_folder_overlapping_the_init_repo_is_refused(tmp_path) -> None:
    """The export replaces ``--out`` whole: an ``--out`` equal to ``--init`` (or holding it, or
    inside it) replaced the prior the run started from by the release. Refused naming both; a
    hub id names no folder."""
    from training.recipes.finetune import FinetuneConfig

    prior = tmp_path / "prior"
    prior.mkdir()
    for out in (prior, tmp_path, prior / "release", prior / ".." / "prior"):
        for config in (VipConfig, FinetuneConfig):
            with pytest.raises(ValidationError, match="--out .* and --init .* overlap"):
                config(init=str(prior), data="d", out=str(out), dataset_name="test/d")
    VipConfig(init=str(prior), data="d", out=str(tmp_path / "release"), dataset_name="test/d")
    VipConfig(init="vip/prior", data="d", out="vip", dataset_name="test/d")
