"""Batch side: pad global [batch, seq] tensors to equal shards and keep this rank's contiguous slice."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .packing import LENGTH_KEYS, PAD_DOC_ID, pack
from .spec import CPSpec
from .transports import resolve_group


@dataclass(frozen=True)
class ShardLayout:
    """How one global batch was split: lengths, padding and every rank's slice of the sequence."""

    seq_len: int
    """Global length before padding."""
    padded_len: int
    """Global length after padding to a multiple of world_size * pad_multiple."""
    world_size: int
    rank: int
    slices: tuple[tuple[int, int], ...]
    """Every rank's ``[start, stop)`` in the padded sequence, in rank order."""
    valid: torch.Tensor
    """This rank's validity mask ``[batch, local_len]``: False on padding."""

    @property
    def local_len(self) -> int:
        return self.padded_len // self.world_size

    @property
    def pad(self) -> int:
        return self.padded_len - self.seq_len

    @property
    def start(self) -> int:
        return self.slices[self.rank][0]


def _pad_value(key: str, t: torch.Tensor, spec: CPSpec, mask_keys: tuple[str, ...]):
    if key == "doc_ids":
        return PAD_DOC_ID
    if key in spec.label_keys:
        return spec.ignore_index
    if key in mask_keys or t.dtype == torch.bool or t.is_floating_point():
        return 0
    return spec.pad_token_id


def shard_batch(batch: Mapping, mesh, spec: CPSpec | None = None, *, pad_multiple: int = 1,
                packed_alignment: int = 1,
                mask_keys: tuple[str, ...] = ("attention_mask", "loss_mask")) -> tuple[dict, ShardLayout]:
    """Pad every sequence tensor of ``batch`` to a multiple of ``P * pad_multiple`` and keep this rank's slice.

    Token inputs are padded with ``spec.pad_token_id``, labels with ``spec.ignore_index`` (so the loss
    ignores padding), position ids by continuing the count, masks with 0. Which entries are sequence
    tensors follows ``spec`` exactly as :func:`cp_passes.cp_compile` does. Non-tensor entries pass through.

    Packed rows (``seq_lens`` / ``seq_lens_padded`` ``[batch, docs]`` with unused slots -1000, or
    ``cu_seqlens``) first become one global layout (see :mod:`cp_passes.packing`): documents moved to
    multiples of ``packed_alignment``, a ``doc_ids`` map (-1 on padding), per-document ``position_ids``
    (given ones are validated), and ``shift_labels`` shifted inside each document from unshifted
    ``labels`` (targets whose ``loss_mask`` is 0 ignored). Validity comes from the lengths.
    """
    cp = resolve_group(mesh)
    return shard_for_rank(batch, cp.rank, cp.size, spec, pad_multiple=pad_multiple,
                          packed_alignment=packed_alignment, mask_keys=mask_keys)


def shard_for_rank(batch: Mapping, rank: int, world_size: int, spec: CPSpec | None = None, *, pad_multiple: int = 1,
                   packed_alignment: int = 1,
                   mask_keys: tuple[str, ...] = ("attention_mask", "loss_mask")) -> tuple[dict, ShardLayout]:
    """:func:`shard_batch` for an explicit rank and world size (no process group needed)."""
    if not isinstance(batch, Mapping):
        raise TypeError(f"shard_batch takes a mapping of named tensors, got {type(batch).__name__}")
    for name, value in (("pad_multiple", pad_multiple), ("packed_alignment", packed_alignment)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    spec = spec if spec is not None else CPSpec()
    dim = spec.seq_dim
    packed_valid = None
    if any(key in batch for key in LENGTH_KEYS):
        batch = pack(dict(batch), dim, spec.ignore_index, spec.pad_token_id, spec.label_keys, spec.position_keys,
                     packed_alignment)
        packed_valid = batch.pop("valid")
    candidates = [(k, v) for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > dim
                  and k not in spec.replicated_inputs and (spec.seq_inputs is None or k in spec.seq_inputs)]
    if not candidates:
        raise ValueError(f"shard_batch found no tensor with a sequence dim {dim} among {list(batch)}")
    seq_len = candidates[0][1].shape[dim]
    multiple = world_size * pad_multiple
    padded = -(-seq_len // multiple) * multiple
    local = padded // world_size
    start = rank * local
    out = {}
    for key, value in batch.items():
        if not (isinstance(value, torch.Tensor) and spec.is_sharded(key, value, seq_len)):
            out[key] = value
            continue
        if value.shape[dim] != seq_len:
            raise ValueError(f"batch[{key!r}] has length {value.shape[dim]} on dim {dim}, expected {seq_len}")
        if padded > seq_len:
            shape = list(value.shape)
            shape[dim] = padded - seq_len
            if key in spec.position_keys:
                steps = torch.arange(1, padded - seq_len + 1, device=value.device, dtype=value.dtype)
                steps = steps.view([-1 if d == dim else 1 for d in range(value.dim())])
                fill = value.narrow(dim, seq_len - 1, 1) + steps
            else:
                fill = torch.full(shape, _pad_value(key, value, spec, mask_keys), dtype=value.dtype,
                                  device=value.device)
            value = torch.cat([value, fill], dim=dim)
        out[key] = value.narrow(dim, start, local).contiguous()
    batch_size = candidates[0][1].shape[0] if dim > 0 else 1
    valid = (torch.arange(start, start + local, device=candidates[0][1].device) < seq_len).expand(batch_size, local)
    if packed_valid is not None:
        valid = torch.cat([packed_valid, packed_valid.new_zeros(batch_size, padded - seq_len)], 1)[:, start:start + local]
    layout = ShardLayout(seq_len, padded, world_size, rank,
                         tuple((r * local, (r + 1) * local) for r in range(world_size)), valid.contiguous())
    return out, layout
