"""The model: a small character-level transformer, its loss and its learning-rate schedule."""

import math

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class CharTransformer(nn.Module):
    """A small GPT over characters: token and learned position embeddings, ``layers`` blocks, a
    final LayerNorm and an output head tied to the token embedding. Every parameter receives a
    gradient at every step (no dropout, every position is used).

    Args:
        vocab_size (int): number of tokens
        seq_len (int): longest sequence (positions with a learned embedding)
        dim (int): model width
        layers (int): transformer blocks
        heads (int): attention heads, dividing ``dim``
    """

    def __init__(self, vocab_size, seq_len, dim, layers, heads):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.zeros(seq_len, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.tok.weight
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:
                # GPT-2's initialisation: residual output projections scaled down with depth
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def lm_loss(model, x, y):
    """Mean next-character cross-entropy of ``model`` on inputs ``x`` and targets ``y``, in float32 (the logits of a
    bfloat16 model are upcast first, so that its loss is not rounded to bfloat16's three significant digits; a
    float32 model's are used as they are)."""
    logits = model(x)
    return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), y.reshape(-1))


def warmup_cosine(steps, warmup, final_fraction=0.1):
    """LambdaLR multiplier: linear warm-up over ``warmup`` steps, then cosine to ``final_fraction``."""

    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return final_fraction + (1.0 - final_fraction) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


# ------------------------------------------------------------------------------------------ training
