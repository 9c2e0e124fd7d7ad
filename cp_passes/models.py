"""Built-in example model: a small Llama-style causal LM written for one device, with no CP code in it.

RMSNorm, rotary positions (from ``position_ids`` or an ``arange`` over the sequence), grouped-query
attention through ``scaled_dot_product_attention(is_causal=True)`` with K/V heads repeated the way
many codebases do it, a SwiGLU MLP and a tied-free LM head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class ToyLlamaConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 128
    rope_theta: float = 10000.0
    kv_repeat: str = "expand"
    """How K/V heads are repeated for GQA: "expand" (x[:, :, None].expand().reshape()),
    "repeat_interleave", or "sdpa" (enable_gqa=True)."""


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ToyLlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        cfg = self.cfg
        q = self.wq(x).view(b, s, cfg.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, cfg.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, cfg.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        n_rep = cfg.n_heads // cfg.n_kv_heads
        gqa = cfg.kv_repeat == "sdpa" and n_rep > 1
        if cfg.kv_repeat == "expand" and n_rep > 1:
            k = k[:, :, None].expand(b, cfg.n_kv_heads, n_rep, s, self.head_dim).reshape(b, cfg.n_heads, s, self.head_dim)
            v = v[:, :, None].expand(b, cfg.n_kv_heads, n_rep, s, self.head_dim).reshape(b, cfg.n_heads, s, self.head_dim)
        elif cfg.kv_repeat == "repeat_interleave" and n_rep > 1:
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, cfg: ToyLlamaConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.dim)
        self.gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class ToyLlama(nn.Module):
    """``forward(input_ids, position_ids=None, labels=None)``.

    Without ``position_ids`` positions are ``arange(seq_len)``. With ``labels`` (already shifted,
    ignore index -100) it returns ``(summed token cross-entropy, logits)``.
    """

    def __init__(self, cfg: ToyLlamaConfig = ToyLlamaConfig()):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        head_dim = cfg.dim // cfg.n_heads
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids, position_ids=None, labels=None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        angles = position_ids[..., None].float() * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)[:, None]
        cos, sin = angles.cos(), angles.sin()
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")
        return loss, logits
