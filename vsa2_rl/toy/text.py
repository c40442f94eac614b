"""Tiny built-in text encoder of the toy model: word-level tokenizer + small transformer.

Stands in for Wan's UMT5 in the embedded default, so nothing is downloaded. The tokenizer maps
lower-cased words of the synthetic prompt vocabulary (:mod:`vsa2_rl.toy.data`) to ids, any
other word to ``<unk>``; the encoder is a token + position embedding and one pre-norm transformer
layer, trained jointly with the toy DiT by :mod:`vsa2_rl.toy.build`. Like the Wan pipeline,
the output is zero past each prompt's last token, padded to a fixed length.
"""

from __future__ import annotations

import torch
from torch import nn

from vsa2_rl.toy.data import COLORS, DIRECTIONS, SHAPES, TRAVEL

PAD, UNK = "<pad>", "<unk>"


def toy_vocabulary() -> list[str]:
    """Tokens of the toy task: specials, then every word the synthetic prompts use."""
    words = ["a", "moving", *COLORS, *SHAPES, *DIRECTIONS, *TRAVEL]
    return [PAD, UNK, *words]


class WordTokenizer:
    """Whitespace word tokenizer over a fixed vocabulary; unknown words -> ``<unk>``."""

    def __init__(self, vocabulary: list[str], max_length: int) -> None:
        if len(set(vocabulary)) != len(vocabulary) or vocabulary[:2] != [PAD, UNK]:
            raise ValueError(f"vocabulary must be unique and start with {PAD}, {UNK}")
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        self.vocabulary = list(vocabulary)
        self.max_length = max_length
        self._ids = {word: i for i, word in enumerate(vocabulary)}

    def __call__(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids int64 [B, max_length], mask bool [B, max_length]); long prompts are truncated."""
        ids = torch.zeros(len(prompts), self.max_length, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            words = prompt.lower().replace(",", " ").replace(".", " ").split()[: self.max_length]
            ids[row, : len(words)] = torch.tensor(
                [self._ids.get(w, 1) for w in words], dtype=torch.long
            )
        return ids, ids != 0


class ToyTextEncoder(nn.Module):
    """Embedding + one transformer layer -> [B, L, dim], zeros at padding positions."""

    def __init__(self, vocab_size: int, dim: int, max_length: int, heads: int = 2) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab_size, dim)
        self.position = nn.Parameter(torch.randn(max_length, dim) * 0.02)
        self.layer = nn.TransformerEncoderLayer(
            dim, heads, dim_feedforward=2 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.norm = nn.LayerNorm(dim)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.token(ids) + self.position[: ids.shape[1]]
        # An all-padding row (empty prompt) would give NaN softmax rows; let it see position 0.
        key_padding = ~mask
        key_padding[:, 0] = False
        x = self.layer(x, src_key_padding_mask=key_padding)
        return self.norm(x) * mask.unsqueeze(-1).to(x.dtype)
