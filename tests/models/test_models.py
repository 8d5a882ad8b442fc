import pytest
import torch
from support.helpers import TINY, tiny_encoder
from timm.models.vision_transformer import VisionTransformer

from vip_hub import ARCHS, EncoderSpec, create_encoder, extract_features, feature_dim
from vip_hub.models.encoders import sincos_pos_embed_2d
from vip_hub.models.features import final_norm


@pytest.mark.parametrize(
    "name,width,depth,heads",
    [
        ("vip-nano", 192, 12, 12),
        ("vip-tiny", 384, 12, 12),
        ("vip-small", 576, 12, 12),
        ("vip-base", 768, 12, 12),
        ("vip-large", 1024, 24, 16),
    ],
)
def test_family_matches_design(name, width, depth, heads):
    a = ARCHS[name]
    assert (a.embed_dim, a.depth, a.num_heads) == (width, depth, heads)
    assert (a.decoder_embed_dim, a.decoder_depth, a.decoder_num_heads) == (512, 4, 16)
    with torch.device("meta"):
        m = create_encoder(EncoderSpec(name))
    assert isinstance(m, VisionTransformer)
    assert m.embed_dim == width and len(m.blocks) == depth
    assert all(b.attn.num_heads == heads for b in m.blocks)
    assert m.patch_embed.patch_size == (16, 16) and m.patch_embed.img_size == (224, 224)
    assert m.blocks[0].norm1.eps == 1e-6 and m.blocks[0].attn.qkv.bias is not None
    assert m.blocks[0].mlp.fc1.out_features == 4 * width


def test_paper_parameter_count_base():
    # Table 5: ViP-Base with its 4 x 512 decoder has 99.0M parameters; the encoder alone ~85.8M.
    with torch.device("meta"):
        m = create_encoder(EncoderSpec("vip-base"))
    n = sum(p.numel() for p in m.parameters())
    assert 85.5e6 < n < 86.1e6


def test_other_sizes_and_errors():
    m = create_encoder(EncoderSpec("vip-nano", img_size=48, patch_size=8))
    assert m.patch_embed.num_patches == 36
    with pytest.raises(ValueError, match="multiple of patch_size"):
        EncoderSpec("vip-nano", img_size=50)
    with pytest.raises(ValueError, match="unknown architecture 'vip-huge'.*vip-nano"):
        EncoderSpec("vip-huge")


def test_sincos_pos_embed():
    e = sincos_pos_embed_2d(192, 4)
    assert e.shape == (17, 192)
    assert torch.all(e[0] == 0)
    grid = e[1:].reshape(4, 4, 192)
    # first half of the channels varies with the column only, second half with the row only
    assert torch.allclose(grid[0, :, :96], grid[3, :, :96])
    assert torch.allclose(grid[:, 0, 96:], grid[:, 3, 96:])
    assert not torch.allclose(grid[0, 0, :96], grid[0, 1, :96])
    m = create_encoder(TINY, mae_init=True)
    assert not m.pos_embed.requires_grad


def _reference_features(model, x):
    """Features computed independently: forward hooks on the blocks, no forward_intermediates."""
    outs = []
    hooks = [b.register_forward_hook(lambda _m, _i, o: outs.append(o)) for b in model.blocks]
    try:
        tokens = model.forward_features(x)  # pre-norm tokens: norm is Identity in our layout
    finally:
        for h in hooks:
            h.remove()
    norm = model.fc_norm
    vip = torch.cat([o[:, 1:].mean(1) for o in outs[-6:]], dim=1)
    return {
        "cls": norm(tokens[:, 0]),
        "avg": norm(tokens[:, 1:].mean(1)),
        "vip": torch.nn.functional.layer_norm(vip, vip.shape[-1:], eps=1e-6),
    }


def test_feature_modes_match_independent_computation():
    model = tiny_encoder()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        ours = extract_features(model, x, ("cls", "avg", "vip"))
        ref = _reference_features(model, x)
        default = model(x)
    for mode in ("cls", "avg", "vip"):
        assert ours[mode].shape == (3, feature_dim(model, mode))
        torch.testing.assert_close(ours[mode], ref[mode], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(default, ours["avg"])  # timm's own forward is the avg mode
    assert feature_dim(model, "vip") == 6 * 192
    assert final_norm(model) is model.fc_norm
    single = extract_features(model, x, "vip")
    torch.testing.assert_close(single, ours["vip"])
    with pytest.raises(ValueError, match="unknown pooling 'max'"):
        extract_features(model, x, "max")


def test_cli_choices_follow_the_registry():
    from vip_hub.cli.commands import DPCAP_ARCHS, DPCAP_PRESETS, VIP_ARCHS, VIP_PRESETS
    from vip_hub.repo.importer import PRESETS

    assert list(VIP_ARCHS + DPCAP_ARCHS) == list(ARCHS)
    assert {ARCHS[a].family.name for a in VIP_ARCHS} == {"vip"}
    assert {ARCHS[a].family.name for a in DPCAP_ARCHS} == {"dpcap"}
    assert sorted(VIP_PRESETS + DPCAP_PRESETS) == sorted(PRESETS)
    assert all(PRESETS[p]().arch in VIP_ARCHS for p in VIP_PRESETS if p != "vip-base")
    from vip_hub.cli.main import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    for command, presets in (("import-mae", VIP_PRESETS), ("import-dpcap", DPCAP_PRESETS)):
        help_text = commands[command].format_help()
        assert all(name in help_text for name in presets)


@pytest.mark.parametrize(
    "name,width,depth,heads,decoder",
    [
        ("dpcap-nano", 192, 12, 6, (192, 6, 6)),
        ("dpcap-tiny", 384, 12, 6, (384, 6, 6)),
        ("dpcap-small", 576, 12, 12, (576, 6, 12)),
        ("dpcap-base", 768, 12, 12, (768, 6, 12)),
        ("dpcap-large", 1024, 24, 16, (768, 6, 12)),
    ],
)
def test_dpcap_family_matches_reference(name, width, depth, heads, decoder):
    a = ARCHS[name]
    assert a.family.name == "dpcap" and (a.embed_dim, a.depth, a.num_heads) == (width, depth, heads)
    assert (a.decoder_embed_dim, a.decoder_depth, a.decoder_num_heads) == decoder
    with torch.device("meta"):
        m = create_encoder(EncoderSpec(name))
    assert all(b.attn.num_heads == heads for b in m.blocks)
    assert m.blocks[0].attn.qkv.bias is None and m.blocks[0].attn.proj.bias is not None
    assert (
        isinstance(m.fc_norm, torch.nn.Identity) and m.norm.eps == 1e-6
    )  # the final norm on every token


def test_families_declare_known_modes():
    from vip_hub.models.encoders import FAMILIES
    from vip_hub.models.features import POOLINGS

    for family in FAMILIES.values():
        assert set(family.poolings) <= set(POOLINGS) and "avg" in family.poolings
    assert FAMILIES["vip"].poolings[0] == "vip" and FAMILIES["dpcap"].poolings[0] == "dpcap"


def test_spatial_modes_keep_the_grid_normalised_per_example():
    """Patch tokens of the chosen blocks (hooks, no forward_intermediates), pooled to the grid by
    hand, each block's map standardised per example; shapes, widths and errors."""
    torch.manual_seed(0)
    model = create_encoder(EncoderSpec("vip-nano", img_size=32, patch_size=8), mae_init=True)
    model.eval()
    x = torch.randn(3, 3, 32, 32)
    outs = []
    hooks = [b.register_forward_hook(lambda _m, _i, o: outs.append(o)) for b in model.blocks]
    with torch.no_grad():
        model.forward_features(x)
        for h in hooks:
            h.remove()
        ours = extract_features(model, x, ("spatial-b4-g2", "avg", "spatial-b4.12-g4"))
    assert list(ours) == ["spatial-b4-g2", "avg", "spatial-b4.12-g4"]  # in the order asked
    for block in (4, 12):
        patches = outs[block - 1][:, 1:].reshape(3, 4, 4, 192)  # a 4 x 4 patch grid, row-major
        quads = patches.reshape(3, 2, 2, 2, 2, 192).mean(dim=(2, 4))  # 2 x 2 cells of 2 x 2
        for grid, pooled in ((4, patches), (2, quads)):
            flat = pooled.permute(0, 3, 1, 2).flatten(1)  # channel-major, as (C, g, g)
            want = (flat - flat.mean(1, keepdim=True)) / (flat.var(1, False, True) + 1e-6).sqrt()
            if (block, grid) == (4, 2):
                torch.testing.assert_close(ours["spatial-b4-g2"], want, atol=1e-4, rtol=1e-4)
            if grid == 4:
                part = ours["spatial-b4.12-g4"][:, (block // 12) * 3072 :][:, :3072]
                torch.testing.assert_close(part, want, atol=1e-4, rtol=1e-4)
    assert ours["spatial-b4.12-g4"].shape == (3, 2 * 192 * 16)
    assert feature_dim(model, "spatial-b4.12-g4") == 6144
    assert feature_dim(model, "spatial-b4-g2") == 768
    halves = ours["spatial-b4.12-g4"].split(3072, dim=1)
    for h in halves:  # each block's map: mean 0, variance 1 per example
        torch.testing.assert_close(h.mean(1), torch.zeros(3), atol=1e-5, rtol=0)
        torch.testing.assert_close(h.var(1, unbiased=False), torch.ones(3), atol=1e-3, rtol=0)
    with pytest.raises(ValueError, match="block 13 of a 12-block"):
        feature_dim(model, "spatial-b13-g2")
    with pytest.raises(ValueError, match="a 5-cell grid from 4 x 4 patches"):
        extract_features(model, x, "spatial-b4-g5")
    with pytest.raises(ValueError, match="increasing order"):
        feature_dim(model, "spatial-b8.4-g2")
    with pytest.raises(ValueError, match="spatial-b<block>"):
        feature_dim(model, "spatial-b04-g2")
