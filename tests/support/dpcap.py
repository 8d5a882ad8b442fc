"""DP-Cap's reference layout, built here (nothing can be downloaded): ``ReferenceDPCap`` follows
facebookresearch/dpcap's ``MaskedAutoencoderViT_autoregressive`` and ``model/torch_transformer.py``
(its key names, its frozen random class token and type embeddings, and its forward passes: manual
attention with the registered causal mask), at a small size; a public vocabulary in BERT's
layout; a checkpoint saved as the reference saves it, and imported and pushed to a hub."""

from __future__ import annotations

import argparse
import functools
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from timm.layers import PatchEmbed
from timm.models.vision_transformer import Block
from torch import nn

from vip_hub.models.encoders import ARCHS
from vip_hub.repo.importer import import_dpcap_checkpoint
from vip_hub.repo.push import push_repo
from vip_hub.repo_format import VOCAB_FILE

from .helpers import synthetic_stage
from .live import WRITE_TOKEN

IMG, WIDTH, DEPTH, TEXT_LEN = 32, 96, 2, 16
ARCH = "dpcap-nano"

# A public vocabulary in BERT's layout ([PAD] 0, [unused*], [UNK] 100, [CLS] 101, [SEP] 102,
# [MASK] 103), then common English words: nothing here is learnt from any caption.
WORDS = """the of and to in is was it for on with as by at from this that be are or an a not but all
which one two three four five six seven eight nine ten there their they have had has were been more
when who will would can could some out up about into than then them these so what its only other new
also time first after two over most such may many any well where way even much our just very through
back years those now people state made like between before own under same both world day few man
house water under long little big small large old young high low left right red green blue black
white yellow orange purple brown gray pink dark light photo picture image painting drawing view
close top side front dog cat bird horse cow sheep fish car bus train boat plane bike truck road
street city building tree flower grass field sky cloud sun beach sea river lake mountain snow rain
table chair bed room kitchen window door wall floor food pizza cake fruit apple banana plate cup
glass bottle shirt hat shoe ball game sport player team child woman girl boy baby face hand head eye
hair group sitting standing walking running playing eating holding looking near next behind inside
outside digit zero number written handwritten ##s ##ing ##ed ##er , . ! ?""".split()
VOCAB = (
    ["[PAD]"]
    + [f"[unused{i}]" for i in range(99)]
    + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    + list(dict.fromkeys(WORDS))
)


def write_vocab(path: Path) -> Path:
    path.write_text("\n".join(VOCAB) + "\n", encoding="utf-8")
    return path


class RefSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, block_size: int = 128):
        super().__init__()
        self.c_attn = nn.Linear(width, 3 * width, bias=False)
        self.c_proj = nn.Linear(width, width, bias=False)
        self.heads = heads
        self.register_buffer(
            "bias",
            torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size),
        )

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (
            y.view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for y in self.c_attn(x).split(c, dim=2)
        )
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf")).softmax(dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(b, t, c))


class RefCrossAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.q_proj = nn.Linear(width, width, bias=False)
        self.kv_proj = nn.Linear(width, 2 * width, bias=False)
        self.c_proj = nn.Linear(width, width, bias=False)
        self.heads = heads

    def forward(self, x, y):
        b, t, c = x.shape
        n = y.shape[1]
        q = self.q_proj(x).view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k, v = (
            z.view(b, n, self.heads, c // self.heads).transpose(1, 2)
            for z in self.kv_proj(y).split(c, dim=2)
        )
        att = ((q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))).softmax(dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(b, t, c))


class RefLayer(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.self_attn = RefSelfAttention(width, heads)
        self.multihead_attn = RefCrossAttention(width, heads)
        self.linear1 = nn.Linear(width, 4 * width, bias=False)
        self.linear2 = nn.Linear(4 * width, width, bias=False)
        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(width) for _ in range(3))

    def forward(self, t, memory):
        t = self.norm1(t + self.self_attn(t))
        t = self.norm2(t + self.multihead_attn(t, memory))
        return self.norm3(t + self.linear2(F.gelu(self.linear1(t))))


class RefDecoder(nn.Module):
    def __init__(self, width: int, heads: int, depth: int):
        super().__init__()
        self.layers = nn.ModuleList(RefLayer(width, heads) for _ in range(depth))


def frozen(*shape):
    return nn.Parameter(torch.randn(*shape) * 0.02, requires_grad=False)


class ReferenceDPCap(nn.Module):
    """The reference model's layout and forward passes, at a small size."""

    def __init__(
        self,
        arch: str = ARCH,
        img_size: int = IMG,
        width: int = WIDTH,
        depth: int = DEPTH,
        vocab_size: int = len(VOCAB),
        text_len: int = TEXT_LEN,
        dec_heads: int = 6,
    ):
        super().__init__()
        a = ARCHS[arch]
        d = a.embed_dim
        norm = functools.partial(nn.LayerNorm, eps=1e-6)
        self.patch_embed = PatchEmbed(img_size, 16, 3, d)
        n = self.patch_embed.num_patches
        self.text_embedding_layer_SimVLM = nn.Embedding(vocab_size, width)
        self.text_pos_embed = frozen(1, text_len, d)
        self.cls_token = frozen(1, 1, d)
        self.pos_embed = frozen(1, n + 1, d)
        self.blocks = nn.ModuleList(
            Block(d, a.num_heads, 4.0, qkv_bias=False, norm_layer=norm) for _ in range(a.depth)
        )
        self.norm = norm(d)
        self.decoder_embed = nn.Linear(d, width)
        self.mask_token = frozen(1, 1, width)
        self.mask_token_text = frozen(1, 1, width)
        self.decoder_pos_embed = frozen(1, n + 1, width)
        self.text_decoder_pos_embed = frozen(1, text_len, width)
        self.decoder = RefDecoder(width, dec_heads, depth)
        self.decoder_pred_text = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, vocab_size))
        self.encoder_image_type_embedding = frozen(1, 1, d)
        self.decoder_image_type_embedding = frozen(1, 1, width)
        self.encoder_text_type_embedding = frozen(1, 1, d)
        self.decoder_text_type_embedding = frozen(1, 1, width)
        for p in self.parameters():  # not a fresh model's init: every weight matters
            if p.requires_grad:
                nn.init.normal_(p, std=0.05)
        with torch.no_grad():  # LayerNorm gains around 1 keep the activations in range
            for m in self.modules():
                if isinstance(m, nn.LayerNorm):
                    m.weight.add_(1.0)

    def forward_encoder(self, imgs):
        x = self.patch_embed(imgs) + self.pos_embed[:, 1:, :]
        cls = (self.cls_token + self.pos_embed[:, :1, :]).expand(x.shape[0], -1, -1)
        x = torch.cat((cls, x), dim=1) + self.encoder_image_type_embedding
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)

    def linear_prob_forward(self, imgs):
        x = self.decoder_embed(self.forward_encoder(imgs))
        return x + self.decoder_pos_embed + self.decoder_image_type_embedding

    def logits(self, imgs, texts):
        x = self.linear_prob_forward(imgs)
        t = self.text_embedding_layer_SimVLM(texts)
        t = t + self.text_decoder_pos_embed[:, : t.shape[1], :] + self.decoder_text_type_embedding
        for layer in self.decoder.layers:
            t = layer(t, x)
        return self.decoder_pred_text(t)

    def loss(self, imgs, texts):
        """The reference's per-example loss (forward with reduction='none')."""
        output = self.logits(imgs, texts).permute(0, 2, 1)
        labels = texts[:, 1:]
        return F.cross_entropy(output[:, :, :-1], labels, ignore_index=0, reduction="none").sum(
            1
        ) / (labels != 0).sum(1)

    def greedy(self, img, max_tokens, bos=101, eos=102):
        """``forward_caption`` for one image: argmax of the next token until [SEP]."""
        text = [bos]
        while len(text) - 1 < max_tokens and (len(text) == 1 or text[-1] != eos):
            text.append(int(self.logits(img[None], torch.tensor([text]))[0, -1].argmax()))
        return text[1:-1] if text[-1] == eos else text[1:]


def save_reference(model: nn.Module, path: Path, **extra) -> Path:
    args = argparse.Namespace(
        model="mae_vit_nano_patch16_autoregressive_nobias",
        target_txt_len=TEXT_LEN,
        sigma=0.5,
        batch_size=64,
    )
    torch.save(
        {"model": model.state_dict(), "args": args, "epoch": 3, "privacy_step": 12, **extra}, path
    )
    return path


DPCAP = "vip/dpcap-nano-test"


def import_reference(checkpoint: Path, folder: Path) -> Path:
    """A reference-layout DP-Cap ``checkpoint`` imported (with a vocabulary) as ``folder``/repo."""
    return import_dpcap_checkpoint(
        checkpoint,
        folder / "repo",
        arch=ARCH,
        img_size=IMG,
        stages=[synthetic_stage()],
        model_name="dpcap-nano-test",
        vocab=write_vocab(folder / VOCAB_FILE),
    )


def publish_dpcap(folder: Path, repo_id: str = DPCAP) -> Path:
    """Import a reference-layout DP-Cap checkpoint (with a vocabulary) and push it to the session
    hub."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    repo = import_reference(
        save_reference(ReferenceDPCap().eval(), folder / "checkpoint.pth"), folder
    )
    push_repo(repo, repo_id, token=WRITE_TOKEN)
    return repo
