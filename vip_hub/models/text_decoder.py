"""The DP-Cap text decoder, its per-example caption loss, and captioning / zero-shot inference.

The architecture is the reference's (facebookresearch/dpcap ``model/torch_transformer.py`` and
``MaskedAutoencoderViT_autoregressive``), written here from its description:

- image memory: ``embed(tokens) + pos_embed + type_embed`` over the encoder's normed tokens
  (reference ``decoder_embed``, ``decoder_pos_embed``, ``decoder_image_type_embedding``); its mean
  over tokens is the ``dpcap`` feature mode (``vip_hub.models.features``);
- text: ``token_embed(ids) + text_pos_embed + text_type_embed`` (fixed 1-D sin-cos positions);
- ``depth`` post-LayerNorm blocks: causal self-attention, add, norm1; cross-attention to the
  image memory, add, norm2; MLP (GELU), add, norm3; linear layers without bias, LayerNorm
  eps 1e-5, no dropout;
- output: LayerNorm then Linear(width, vocab).

It is built only from ``nn.Linear``, ``nn.LayerNorm`` and ``nn.Embedding`` (constants are
buffers, nothing is tied or broadcast as a parameter) and each of them runs once per forward,
so ``training.dp.clipping.PerExampleClipper`` can clip it per example. ``Captioner`` (encoder +
decoder) returns per-example losses, as a DP recipe needs.

A repo stores the decoder in its own safetensors file (its ``TextDecoderConfig`` in the
metadata) and the tokenizer's vocabulary in a file of its own; that file I/O is in
``vip_hub.repo.files`` (``text_decoder_file``, ``load_text_decoder``), and
``vip_hub.loading.load_captioner`` loads a captioning repo.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, cast

import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from ..errors import ConfigError, RepoFormatError
from .encoders import EncoderSpec, mae_init_, sincos_pos_embed_1d, sincos_pos_embed_2d
from .tokenizer import MAX_LENGTH, CaptionTokenizer

__all__ = [
    "DEFAULT_PROMPT",
    "Captioner",
    "ImageMemory",
    "TextDecoder",
    "TextDecoderConfig",
    "caption_loss",
]

DEFAULT_PROMPT = "this is a photo of a"
"""The zero-shot prompt of the DP-Cap README: each label is scored as ``prompt + " " + label``."""
LN_EPS = 1e-5  # the decoder's LayerNorms (PyTorch's default, as in the reference)
_LOGITS_BUDGET = 1 << 25  # logits held at once when scoring many label texts


@dataclass(frozen=True)
class TextDecoderConfig:
    """Sizes of a text decoder, and the token ids it was trained with (stored with its weights)."""

    image_dim: int  # width of the encoder's tokens
    grid_size: int  # the encoder's patch grid: the memory has grid_size**2 + 1 tokens
    width: int = 768
    depth: int = 6
    num_heads: int = 12
    mlp_ratio: float = 4.0
    vocab_size: int = 30522
    max_length: int = MAX_LENGTH  # text positions, [CLS] and [SEP] included
    bos_id: int = 101
    eos_id: int = 102
    pad_id: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            kind, what = (
                ((int, float), "a number") if f.name == "mlp_ratio" else (int, "an integer")
            )
            if isinstance(value, bool) or not isinstance(value, kind):
                raise ConfigError(f"text decoder: {f.name} must be {what}, got {value!r}")
        if not 0 < self.mlp_ratio < math.inf:
            raise ConfigError(
                f"text decoder: mlp_ratio must be positive and finite, got {self.mlp_ratio}"
            )
        for name in ("image_dim", "grid_size", "width", "depth", "num_heads", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(
                    f"text decoder: {name} must be positive, got {getattr(self, name)}"
                )
        if self.width % self.num_heads or self.width % 4:
            raise ConfigError(
                f"text decoder: width {self.width} must be divisible by 4 and by num_heads "
                f"{self.num_heads}"
            )
        if self.max_length < 2:
            raise ConfigError(f"text decoder: max_length must be at least 2, got {self.max_length}")
        bad = [
            n for n in ("bos_id", "eos_id", "pad_id") if not 0 <= getattr(self, n) < self.vocab_size
        ]
        if bad:
            raise ConfigError(
                f"text decoder: {', '.join(bad)} outside the vocabulary of {self.vocab_size}"
            )

    @property
    def num_image_tokens(self) -> int:
        return self.grid_size**2 + 1

    def check_tokenizer(self, tokenizer: CaptionTokenizer) -> None:
        """Raise ConfigError unless ``tokenizer``'s vocabulary size and special ids are this
        decoder's."""
        ids = (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)
        want = (self.vocab_size, self.bos_id, self.eos_id, self.pad_id)
        if ids != want:
            raise ConfigError(
                f"the vocabulary's (size, [CLS], [SEP], [PAD]) = {ids} does not match the text "
                f"decoder's {want}"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TextDecoderConfig:
        """Rebuild from ``to_dict``'s output; unknown keys are an error."""
        if not isinstance(data, dict):
            raise RepoFormatError(f"text decoder config: not an object ({data!r:.60})")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RepoFormatError(f"text decoder config: unknown keys {', '.join(unknown)}")
        try:
            return cls(**data)
        except TypeError as e:
            raise RepoFormatError(f"text decoder config: {e}") from None

    @classmethod
    def for_encoder(
        cls, spec: EncoderSpec, tokenizer: CaptionTokenizer | None = None, **sizes: Any
    ) -> TextDecoderConfig:
        """The family's decoder for ``spec``'s size (reference: 6 blocks, width of the encoder up
        to 768); token ids and vocabulary size from ``tokenizer`` when given; ``sizes`` override."""
        a = spec.architecture
        ids = {}
        if tokenizer is not None:
            ids = {
                "vocab_size": tokenizer.vocab_size,
                "bos_id": tokenizer.bos_id,
                "eos_id": tokenizer.eos_id,
                "pad_id": tokenizer.pad_id,
                "max_length": tokenizer.max_length,
            }
        base = {
            "image_dim": a.embed_dim,
            "grid_size": spec.grid_size,
            "width": a.decoder_embed_dim,
            "depth": a.decoder_depth,
            "num_heads": a.decoder_num_heads,
        }
        return cls(**{**base, **ids, **sizes})


class ImageMemory(nn.Module):
    """What the decoder attends to: ``embed(tokens) + pos_embed + type_embed`` per image token."""

    pos_embed: torch.Tensor  # buffers (register_buffer)
    type_embed: torch.Tensor

    def __init__(self, image_dim: int, width: int, num_tokens: int):
        super().__init__()
        self.embed = nn.Linear(image_dim, width)
        self.register_buffer("pos_embed", torch.zeros(1, num_tokens, width))
        self.register_buffer("type_embed", torch.zeros(1, 1, width))

    @property
    def width(self) -> int:
        return self.embed.out_features

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, N, image_dim) normed encoder tokens -> (B, N, width) memory."""
        return self.embed(tokens) + self.pos_embed + self.type_embed

    def pooled(self, tokens: torch.Tensor) -> torch.Tensor:
        """The memory's mean over tokens (the ``dpcap`` features), computed as the affine map of
        the mean token: (B, N, image_dim) -> (B, width)."""
        return self.embed(tokens.mean(dim=1)) + (self.pos_embed.mean(dim=1) + self.type_embed[:, 0])


def _split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.unflatten(-1, (heads, -1)).transpose(1, 2)  # (B, T, C) -> (B, H, T, C/H)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2).flatten(2)


class SelfAttention(nn.Module):
    """Causal multi-head self-attention over the text (q, k, v from one projection)."""

    def __init__(self, width: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (_split_heads(t, self.num_heads) for t in self.qkv(x).chunk(3, dim=-1))
        return self.proj(_merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=True)))


class CrossAttention(nn.Module):
    """Multi-head attention of the text to the image memory (keys and values from one
    projection)."""

    def __init__(self, width: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.q = nn.Linear(width, width, bias=False)
        self.kv = nn.Linear(width, 2 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """``kv`` is ``self.kv(memory)``, computed once per image (see ``TextDecoder.cross_kv``)."""
        k, v = (_split_heads(t, self.num_heads) for t in kv.chunk(2, dim=-1))
        q = _split_heads(self.q(x), self.num_heads)
        return self.proj(_merge_heads(F.scaled_dot_product_attention(q, k, v)))


class Mlp(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class DecoderBlock(nn.Module):
    """Post-LayerNorm block: self-attention, cross-attention, MLP, each added then normed."""

    def __init__(self, width: int, num_heads: int, mlp_ratio: float):
        super().__init__()
        self.self_attn = SelfAttention(width, num_heads)
        self.norm1 = nn.LayerNorm(width, eps=LN_EPS)
        self.cross_attn = CrossAttention(width, num_heads)
        self.norm2 = nn.LayerNorm(width, eps=LN_EPS)
        self.mlp = Mlp(width, int(width * mlp_ratio))
        self.norm3 = nn.LayerNorm(width, eps=LN_EPS)

    def forward(self, x: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.self_attn(x))
        x = self.norm2(x + self.cross_attn(x, kv))
        return self.norm3(x + self.mlp(x))


class TextDecoder(nn.Module):
    """The caption decoder; a fresh one is initialised as the reference does (xavier-uniform
    linears, N(0, 1) token embeddings, fixed sin-cos positions, N(0, 0.02) type embeddings)."""

    text_pos_embed: torch.Tensor  # buffers (register_buffer)
    text_type_embed: torch.Tensor

    def __init__(self, config: TextDecoderConfig):
        super().__init__()
        c = self.config = config
        self.memory = ImageMemory(c.image_dim, c.width, c.num_image_tokens)
        self.token_embed = nn.Embedding(c.vocab_size, c.width)
        self.register_buffer("text_pos_embed", torch.zeros(1, c.max_length, c.width))
        self.register_buffer("text_type_embed", torch.zeros(1, 1, c.width))
        self.blocks = nn.ModuleList(
            DecoderBlock(c.width, c.num_heads, c.mlp_ratio) for _ in range(c.depth)
        )
        self.head_norm = nn.LayerNorm(c.width, eps=LN_EPS)
        self.head = nn.Linear(c.width, c.vocab_size)
        self._init_weights()

    def _init_weights(self) -> None:
        c = self.config
        with torch.no_grad():
            self.memory.pos_embed.copy_(sincos_pos_embed_2d(c.width, c.grid_size)[None])
            self.text_pos_embed.copy_(sincos_pos_embed_1d(c.width, c.max_length)[None])
            for t in (self.memory.type_embed, self.text_type_embed):
                nn.init.normal_(t, std=0.02)
            nn.init.normal_(self.token_embed.weight)
            mae_init_(self.modules())

    def cross_kv(self, memory: torch.Tensor) -> list[torch.Tensor]:
        """Each block's cross-attention keys and values of the image ``memory`` (B, N, width)."""
        # a ModuleList yields its items as Modules
        return [cast(DecoderBlock, block).cross_attn.kv(memory) for block in self.blocks]

    def decode(self, text: torch.Tensor, kv: list[torch.Tensor]) -> torch.Tensor:
        """Next-token logits (B, T, vocab) for token ids ``text`` (B, T) given ``cross_kv``."""
        if text.shape[1] > self.config.max_length:
            raise ConfigError(
                f"{text.shape[1]} text tokens, more than this decoder's {self.config.max_length}"
            )
        x = self.token_embed(text) + self.text_pos_embed[:, : text.shape[1]] + self.text_type_embed
        for block, block_kv in zip(self.blocks, kv, strict=True):
            x = block(x, block_kv)
        return self.head(self.head_norm(x))

    def forward(self, image_tokens: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, vocab) for ``text`` (B, T) given the encoder's normed tokens (B, N,
        image_dim)."""
        return self.decode(text, self.cross_kv(self.memory(image_tokens)))


def caption_loss(logits: torch.Tensor, text: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Per-example loss (B,): cross-entropy of each next token, padding ignored, summed over the
    caption and divided by its number of non-pad targets (the reference's loss)."""
    targets = text[:, 1:]
    ce = F.cross_entropy(
        logits[:, :-1].transpose(1, 2).float(), targets, ignore_index=pad_id, reduction="none"
    )
    return ce.sum(dim=1) / (targets != pad_id).sum(dim=1).clamp(min=1)


class Captioner(nn.Module):
    """Image encoder (a dpcap-* timm ViT) + text decoder. ``forward(images, text)`` returns the
    per-example caption losses (B,); each depends on its own example only."""

    def __init__(self, encoder: VisionTransformer, decoder: TextDecoder):
        super().__init__()
        c = decoder.config
        if not isinstance(encoder.fc_norm, nn.Identity):
            raise ConfigError(
                "a captioner needs an encoder with the final norm on every token "
                "(a dpcap-* architecture)"
            )
        if (encoder.embed_dim, encoder.patch_embed.num_patches + 1) != (
            c.image_dim,
            c.num_image_tokens,
        ):
            raise ConfigError(
                f"the text decoder expects {c.num_image_tokens} tokens of width {c.image_dim}, the "
                f"encoder gives {encoder.patch_embed.num_patches + 1} of width {encoder.embed_dim}"
            )
        self.encoder = encoder
        self.decoder = decoder

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """The encoder's tokens, class token first, each through the final norm: (B, N, dim)."""
        return self.encoder.forward_features(images)

    def forward(self, images: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """Per-example caption losses (B,) for images (B, 3, H, W) and token ids (B, T)."""
        return caption_loss(
            self.decoder(self.encode(images), text), text, self.decoder.config.pad_id
        )

    @torch.inference_mode()
    def generate(self, images: torch.Tensor, max_tokens: int) -> list[list[int]]:
        """Greedy captions: for each image, up to ``max_tokens`` token ids after [CLS], stopping at
        [SEP] (not included). ``max_tokens`` is at most ``max_length - 1``."""
        c = self.decoder.config
        if not 1 <= max_tokens <= c.max_length - 1:
            raise ConfigError(
                f"max_tokens must be between 1 and {c.max_length - 1}, got {max_tokens}"
            )
        kv = self.decoder.cross_kv(self.decoder.memory(self.encode(images)))
        text = torch.full((images.shape[0], 1), c.bos_id, dtype=torch.long, device=images.device)
        done = torch.zeros(images.shape[0], dtype=torch.bool, device=images.device)
        for _ in range(max_tokens):
            step = self.decoder.decode(text, kv)[:, -1].argmax(dim=-1)
            step = torch.where(done, c.pad_id, step)
            text = torch.cat([text, step[:, None]], dim=1)
            done |= step == c.eos_id
            if bool(done.all()):
                break
        out = []
        for row in text[:, 1:].tolist():
            out.append(row[: row.index(c.eos_id)] if c.eos_id in row else row)
        return out

    @torch.inference_mode()
    def text_losses(self, images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
        """Caption loss of every text (L, T) for every image: (B, L). Zero-shot picks the
        smallest."""
        c = self.decoder.config
        kv = self.decoder.cross_kv(self.decoder.memory(self.encode(images)))
        rows = max(1, _LOGITS_BUDGET // (texts.shape[1] * c.vocab_size))
        out = torch.empty(images.shape[0], texts.shape[0], device=images.device)
        for b in range(images.shape[0]):
            for start in range(0, texts.shape[0], rows):
                part = texts[start : start + rows]
                image_kv = [k[b : b + 1].expand(part.shape[0], -1, -1) for k in kv]
                logits = self.decoder.decode(part, image_kv)
                out[b, start : start + part.shape[0]] = caption_loss(logits, part, c.pad_id)
        return out
