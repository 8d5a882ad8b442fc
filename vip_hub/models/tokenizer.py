"""The caption tokenizer: BERT uncased WordPiece over a fixed vocabulary file (BERT's layout),
run by the ``tokenizers`` library, with the DP-Cap reference's conventions: a caption is
``[CLS] tokens [SEP]`` (BOS = ``[CLS]``, EOS = ``[SEP]``, 101 and 102 in BERT's vocabulary),
padded with ``[PAD]`` (0) and cut at 40 tokens.

The vocabulary is a public file fixed before training (the reference uses BERT's
``bert-base-uncased`` vocabulary, 30,522 entries). It is never fitted on the private captions:
a vocabulary learnt from private text would itself be a release of that text, outside any
privacy ledger. A repo that captions carries its vocabulary (``vip_hub.repo_format.VOCAB_FILE``),
so it is self-contained.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import BertWordPieceTokenizer, Tokenizer
from tokenizers.normalizers import BertNormalizer
from tokenizers.pre_tokenizers import BertPreTokenizer

from ..errors import ConfigError
from ..repo_format import VOCAB_FILE

__all__ = ["BERT_SPECIAL_IDS", "MAX_LENGTH", "SPECIAL_TOKENS", "CaptionTokenizer", "public_vocab"]

MAX_LENGTH = 40
"""Tokens of a caption, [CLS] and [SEP] included (the reference's ``target_txt_len``)."""
_SURROGATE = re.compile("[\ud800-\udfff]")
"""A lone UTF-16 surrogate: how Python holds a byte that did not decode (surrogateescape)."""
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
BERT_SPECIAL_IDS = {"[PAD]": 0, "[UNK]": 100, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103}
"""Where ``bert-base-uncased``'s vocabulary file keeps the special tokens (ids 1-99 are
``[unused0]``...)."""


class CaptionTokenizer:
    """WordPiece tokenizer over ``vocab`` (the bytes or path of a BERT-style vocabulary file)."""

    def __init__(self, vocab: bytes | str | os.PathLike[str], max_length: int = MAX_LENGTH):
        data = vocab if isinstance(vocab, bytes) else Path(vocab).read_bytes()
        try:
            tokens = data.decode("utf-8").splitlines()
        except UnicodeDecodeError as e:
            raise ConfigError(f"vocabulary is not UTF-8 text ({e})") from None
        index: dict[str, int] = {}
        for i, token in enumerate(tokens):
            if not token or token in index:
                raise ConfigError(
                    f"vocabulary line {i + 1}: {'empty' if not token else f'duplicate {token!r}'}"
                )
            index[token] = i
        missing = [t for t in SPECIAL_TOKENS if t not in index]
        if missing:
            raise ConfigError(
                f"vocabulary lacks the special tokens {', '.join(missing)} "
                f"(a BERT-style {VOCAB_FILE} has them)"
            )
        if max_length < 2:
            raise ConfigError(f"max_length must be at least 2 ([CLS] and [SEP]), got {max_length}")
        self.vocab_size = len(tokens)
        self.pad_id, self.bos_id, self.eos_id = index["[PAD]"], index["[CLS]"], index["[SEP]"]
        self.max_length = max_length
        self._tok = Tokenizer.from_str(BertWordPieceTokenizer(index, lowercase=True).to_str())
        # "[SEP]" or "[PAD]" in a text is text: special tokens come only from the template
        self._tok.encode_special_tokens = True
        self._tok.enable_truncation(max_length)
        self._tok.enable_padding(pad_id=self.pad_id, pad_token="[PAD]")

    def encode(self, texts: Sequence[str], *, cut: bool = True) -> torch.Tensor:
        """``[CLS] text [SEP]`` for each text, cut at ``max_length`` (keeping [SEP]) and padded
        with [PAD] to the longest: a (len(texts), T) long tensor. With ``cut=False`` a text
        longer than ``max_length`` tokens is a ConfigError naming it instead."""
        if not texts:
            return torch.empty(0, 2, dtype=torch.long)
        encodings = self._encodings(texts)
        if not cut:
            for i, e in enumerate(encodings):
                if e.overflowing:
                    raise ConfigError(
                        f"text {i} ({texts[i][:60]!r}) is longer than {self.max_length} tokens"
                    )
        return torch.tensor([e.ids for e in encodings], dtype=torch.long)

    def lengths(self, texts: Sequence[str]) -> list[int]:
        """Tokens of each text cut at ``max_length``, [CLS] and [SEP] left out (0: nothing the
        normalizer keeps)."""
        return [sum(e.attention_mask) - 2 for e in self._encodings(texts)]

    def _encodings(self, texts: Sequence[str]) -> list[Any]:
        """The tokenizer's encodings; ConfigError for a text that is not Unicode text (a lone
        surrogate: a byte the shell could not decode), which the tokenizer takes for no text."""
        for i, text in enumerate(texts):
            if not isinstance(text, str) or _SURROGATE.search(text):
                raise ConfigError(
                    f"text {i} ({text[:60]!r}) is not Unicode text: a byte the shell could not "
                    "decode as UTF-8?"
                )
        return self._tok.encode_batch(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids, special tokens dropped and word pieces joined."""
        return self._tok.decode(list(ids), skip_special_tokens=True)


def public_vocab(texts: Iterable[str]) -> bytes:
    """A vocabulary file in BERT's layout (the special tokens at ``BERT_SPECIAL_IDS``, ``[unused*]``
    between them) followed by the words of ``texts``, lowercased as the tokenizer reads them,
    sorted. Only for public texts (templates, label names): it releases every word it holds."""
    normalizer, split = BertNormalizer(lowercase=True), BertPreTokenizer()
    words = sorted(
        {w for text in texts for w, _ in split.pre_tokenize_str(normalizer.normalize_str(text))}
    )
    if not words:
        raise ConfigError("a vocabulary needs at least one word")
    by_id = {i: token for token, i in BERT_SPECIAL_IDS.items()}
    head = [by_id.get(i, f"[unused{i - 1}]") for i in range(max(by_id) + 1)]
    return ("\n".join(head + words) + "\n").encode()
