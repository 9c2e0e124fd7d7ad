"""Built-in example model: a small Llama-style causal LM written for one device, with no CP code in it.

RMSNorm, rotary positions (from ``position_ids`` or an ``arange`` over the sequence), grouped-query
attention through ``scaled_dot_product_attention(is_causal=True)`` with K/V heads repeated the way
many codebases do it, a SwiGLU MLP and an LM head. Optionally sliding-window attention (a band mask
the model builds itself) and a short causal convolution before attention (Mamba / delta-net style).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


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
    window: int | None = None
    """Sliding-window attention of this width (a band mask built from arange); None: causal."""
    inplace_mask: bool = False
    """Build the band mask with in-place ops (``band &= distance < window``), as much model code does."""
    conv_kernel: int | tuple[int, ...] = 0
    """Kernel size of a causal short convolution on the attention input (a tuple: one per layer); 0: none."""
    conv_dilation: int = 1
    conv_form: str = "slice"
    """"slice": conv1d(padding=(k-1)*d)[..., :seq] (Hugging Face Mamba); "pad": F.pad((k-1)*d, 0) then conv1d."""
    conv_depthwise: bool = True
    checkpoint: bool = False
    """Run each block under ``torch.utils.checkpoint`` while training (activation checkpointing: the blocks'
    activations are recomputed in the backward instead of saved)."""


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

    def forward(self, x, cos, sin, doc_ids=None):
        b, s, _ = x.shape
        cfg = self.cfg
        q = self.wq(x).view(b, s, cfg.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, cfg.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, cfg.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        n_rep = cfg.n_heads // cfg.n_kv_heads
        gqa = cfg.kv_repeat == "sdpa" and n_rep > 1
        if cfg.kv_repeat == "expand" and n_rep > 1:
            k = (k[:, :, None].expand(b, cfg.n_kv_heads, n_rep, s, self.head_dim)
                 .reshape(b, cfg.n_heads, s, self.head_dim))
            v = (v[:, :, None].expand(b, cfg.n_kv_heads, n_rep, s, self.head_dim)
                 .reshape(b, cfg.n_heads, s, self.head_dim))
        elif cfg.kv_repeat == "repeat_interleave" and n_rep > 1:
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
        if cfg.window is None and doc_ids is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            pos = torch.arange(s, device=x.device)
            distance = pos[:, None] - pos[None, :]
            band = distance >= 0
            if cfg.window is not None and cfg.inplace_mask:
                band &= distance < cfg.window
            elif cfg.window is not None:
                band = band & (distance < cfg.window)
            if doc_ids is not None:  # packed documents: attend within the same document only
                band = band & (doc_ids[:, :, None] == doc_ids[:, None, :])
                band = band[:, None]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=band, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class ShortConv(nn.Module):
    """A causal convolution along the sequence: output t reads inputs t - (k-1)*d .. t."""

    def __init__(self, cfg: ToyLlamaConfig, kernel: int):
        super().__init__()
        self.cfg = cfg
        self.halo = (kernel - 1) * cfg.conv_dilation
        self.conv = nn.Conv1d(cfg.dim, cfg.dim, kernel, dilation=cfg.conv_dilation,
                              groups=cfg.dim if cfg.conv_depthwise else 1,
                              padding=self.halo if cfg.conv_form == "slice" else 0)

    def forward(self, x):
        seq = x.shape[1]
        h = x.transpose(1, 2)
        if self.cfg.conv_form == "slice":
            h = self.conv(h)[..., :seq]
        else:
            h = self.conv(F.pad(h, (self.halo, 0)))
        return F.silu(h.transpose(1, 2))


class Block(nn.Module):
    def __init__(self, cfg: ToyLlamaConfig, layer: int):
        super().__init__()
        kernel = cfg.conv_kernel[layer] if isinstance(cfg.conv_kernel, tuple) else cfg.conv_kernel
        self.attn_norm = nn.RMSNorm(cfg.dim)
        self.conv = ShortConv(cfg, kernel) if kernel else None
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.dim)
        self.gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin, doc_ids=None):
        h = self.attn_norm(x)
        if self.conv is not None:
            h = h + self.conv(h)
        x = x + self.attn(h, cos, sin, doc_ids)
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class ToyLlama(nn.Module):
    """``forward(input_ids, position_ids=None, labels=None, doc_ids=None)``.

    Without ``position_ids`` positions are ``arange(seq_len)``. With ``labels`` (already shifted,
    ignore index -100) it returns ``(summed token cross-entropy, logits)``. With ``doc_ids`` (packed
    documents) attention stays inside each document.
    """

    def __init__(self, cfg: ToyLlamaConfig = ToyLlamaConfig()):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        head_dim = cfg.dim // cfg.n_heads
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids, position_ids=None, labels=None, doc_ids=None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        angles = position_ids[..., None].float() * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)[:, None]
        x = self.embed(input_ids)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)  # bf16 parameters: bf16 rotations
        checkpointed = self.cfg.checkpoint and self.training and torch.is_grad_enabled()
        for layer in self.layers:
            if checkpointed:
                x = checkpoint(layer, x, cos, sin, doc_ids, use_reentrant=False)
            else:
                x = layer(x, cos, sin, doc_ids)
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")
        return loss, logits


def in_dtype(dtype: torch.dtype, make):
    """``make()`` with floating-point tensors created in ``dtype`` (the dry run builds models without
    ``.to()``, which cannot swap fake parameters)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return make()
    finally:
        torch.set_default_dtype(default)


def built_in(config: ToyLlamaConfig, dtype: torch.dtype = torch.float32) -> ToyLlama:
    """``ToyLlama(config)`` with its parameters created in ``dtype``."""
    return in_dtype(dtype, lambda: ToyLlama(config))


EXAMPLES = {
    "toy-llama": ("the demo's ToyLlama: 2 layers, dim 64, GQA 4/2 heads", ToyLlamaConfig()),
    "toy-llama-swa": ("ToyLlama with sliding-window attention (window 4096) and a causal conv (kernel 4)",
                      ToyLlamaConfig(window=4096, conv_kernel=4)),
    "llama-8b": ("a Llama-3-8B-shaped ToyLlama: 32 layers, dim 4096, 32 heads, 8 KV heads, ffn 14336",
                 ToyLlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336)),
}
"""Built-in examples for ``python -m cp_passes explain``: name -> (description, config)."""


def hf_model(name: str, dtype: torch.dtype = torch.float32):
    """``(build, config)`` for a transformers model: ``name`` is a model class (``DeepseekV4ForCausalLM``), a model
    type (``llama``: its causal LM), or a path to a ``config.json`` or a folder holding one; the model is built
    from the config's defaults (or the file's values) with parameters in ``dtype``, for training (no KV cache): its
    causal LM, else (a vision-language model) its image-text-to-text model, run on text alone, else its base
    model."""
    import os

    import transformers

    cls = getattr(transformers, name, None)
    if isinstance(cls, type) and issubclass(cls, torch.nn.Module) and hasattr(cls, "config_class"):
        config = cls.config_class()
    else:
        if os.path.exists(name):
            config = transformers.AutoConfig.from_pretrained(name)
        else:
            try:
                config = transformers.AutoConfig.for_model(name)
            except ValueError:
                raise SystemExit(f"--hf-config {name!r} is neither a transformers model class, a model type nor a "
                                 f"config path") from None
        cls = _model_class(config, name)
    cache_off(config)
    return (lambda: in_dtype(dtype, lambda: cls(config))), config, cls.__name__


def _model_class(config, name: str) -> type:
    import transformers

    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForImageTextToText, transformers.AutoModel):
        if type(config) in auto._model_mapping:
            return auto._model_mapping[type(config)]
    raise SystemExit(f"--hf-config {name!r}: transformers has no causal LM, image-text-to-text or base model for "
                     f"{type(config).__name__}; name a model class instead")


def factory_model(path: str, dtype: torch.dtype = torch.float32):
    """``build`` for ``module:factory``, a function that returns the model (parameters created in ``dtype``)."""
    import importlib

    module_name, _, attribute = path.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise SystemExit(f"cannot load the model factory {path!r}: {error}") from None
    return lambda: for_training(in_dtype(dtype, factory))


def for_training(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` as a training step runs it: a transformers model's KV cache off (``use_cache``: a step never reads
    it, and a cache in the outputs is not a tensor the dry run can follow), as ``--hf-config`` builds it."""
    cache_off(getattr(model, "config", None))
    return model


def cache_off(config) -> None:
    """A transformers config, and those of its parts (a vision-language model's text model), with ``use_cache``
    off, as a training step runs."""
    for part in [config] + [getattr(config, name, None) for name in getattr(config, "sub_configs", {})]:
        if getattr(part, "use_cache", False):
            part.use_cache = False
