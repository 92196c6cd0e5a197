"""Tiny transformer encoder classifier with two integer inputs.

Inputs:  ``input_ids`` int64 ``[B, T]`` (ids < 1000, 0 used as padding) and
         ``attention_mask`` int64 ``[B, T]`` (1 = token, 0 = padding), ``T <= 64``.
Output:  logits float32 ``[B, 4]``.

Attention is written out by hand (Linear / MatMul / Softmax) instead of using
``nn.TransformerEncoderLayer``, whose fused fast path does not export cleanly
to ONNX. Padding is masked with an additive bias of ``-1e4`` (not ``-inf``), so
a fully padded row still gives finite values; padded key positions get exactly
zero attention weight in float32 and padded positions are excluded from the
masked mean pooling, so the ids at padded positions never affect the output.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["TinyEncoderClassifier", "build_tiny_encoder", "MASK_BIAS"]

MASK_BIAS = -1.0e4


class MultiHeadSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError("d_model must be divisible by n_heads")
        self.n_heads = n_heads
        self.d_head = d_model // n_heads
        self.scale = 1.0 / math.sqrt(self.d_head)
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        # [B, T, D] -> [B, H, T, Dh]
        b, t = x.shape[0], x.shape[1]
        return x.reshape(b, t, self.n_heads, self.d_head).transpose(1, 2)

    def forward(self, x: torch.Tensor, mask_bias: torch.Tensor) -> torch.Tensor:
        # x: [B, T, D]; mask_bias: [B, 1, 1, T] (0 for tokens, -1e4 for padding)
        q = self._split_heads(self.q_proj(x))
        k = self._split_heads(self.k_proj(x))
        v = self._split_heads(self.v_proj(x))
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale + mask_bias
        weights = torch.softmax(scores, dim=-1)
        ctx = torch.matmul(weights, v)  # [B, H, T, Dh]
        b, t = x.shape[0], x.shape[1]
        ctx = ctx.transpose(1, 2).reshape(b, t, self.n_heads * self.d_head)
        return self.out_proj(ctx)


class EncoderBlock(nn.Module):
    """Pre-LayerNorm block: x + MHSA(LN(x)), then x + FFN(LN(x))."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = MultiHeadSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.ff1 = nn.Linear(d_model, d_ff)
        self.act = nn.GELU()
        self.ff2 = nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor, mask_bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask_bias)
        x = x + self.ff2(self.act(self.ff1(self.ln2(x))))
        return x


class TinyEncoderClassifier(nn.Module):
    def __init__(
        self,
        vocab_size: int = 1000,
        d_model: int = 64,
        n_heads: int = 4,
        n_layers: int = 2,
        d_ff: int = 128,
        max_len: int = 64,
        num_classes: int = 4,
    ) -> None:
        super().__init__()
        self.max_len = max_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model)
        self.register_buffer(
            "position_ids", torch.arange(max_len, dtype=torch.int64)[None, :], persistent=False
        )
        self.layers = nn.ModuleList(EncoderBlock(d_model, n_heads, d_ff) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        seq_len = input_ids.shape[1]
        pos = self.position_ids[:, :seq_len]
        x = self.tok_emb(input_ids) + self.pos_emb(pos)  # [B, T, D]
        mask = attention_mask.to(x.dtype)  # [B, T]
        mask_bias = ((1.0 - mask) * MASK_BIAS)[:, None, None, :]  # [B, 1, 1, T]
        for layer in self.layers:
            x = layer(x, mask_bias)
        x = self.ln_f(x)
        # masked mean pooling over real tokens
        m = mask[:, :, None]
        pooled = (x * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
        return self.head(pooled)


def build_tiny_encoder(seed: int = 0) -> TinyEncoderClassifier:
    """Seeded, randomly initialised encoder classifier in eval mode."""
    torch.manual_seed(seed)
    return TinyEncoderClassifier().eval()
