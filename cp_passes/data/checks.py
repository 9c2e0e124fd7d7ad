"""Checks on a global batch before :func:`cp_passes.shard_batch` packs, pads or slices anything.

Every refusal names the key; document lengths are checked in :mod:`cp_passes.data.packing`, naming the row
and the document.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

import torch

from .packing import LENGTH_KEYS, PAD_DOC_ID
from ..spec import CPSpec

MASK_KEYS = ("attention_mask", "loss_mask")
"""Batch keys padded with 0 besides shard_batch's ``mask_keys``."""
"""Keys whose tensor gives the batch its rows and length, in order of preference."""


@dataclass(frozen=True)
class Padding:
    """What each sequence key of one batch is padded with."""

    spec: CPSpec
    masks: tuple[str, ...]
    packed: bool
    """Packing adds ``position_ids`` and ``shift_labels``, padded as positions and labels."""

    def value(self, key: str, tensor: torch.Tensor):
        """The pad value of ``tensor`` under ``key``; None for positions (the count continues)."""
        spec = self.spec
        if self.is_position(key):
            return None
        if key == spec.doc_key:
            return PAD_DOC_ID
        if key in spec.label_keys or (self.packed and key == spec.packed_labels[1]):
            return spec.ignore_index
        if key in spec.token_keys:
            return spec.pad_token_id
        if key in self.masks or tensor.dtype == torch.bool or tensor.is_floating_point():
            return 0
        fields = {"token_keys": spec.token_keys, "label_keys": spec.label_keys, "position_keys": spec.position_keys,
                  "mask_keys": self.masks, "replicated_inputs": spec.replicated_inputs}
        close = [f"{name!r} in {field}" for field, names in fields.items()
                 for name in difflib.get_close_matches(key, names, n=1, cutoff=0.8)]
        hint = f"; did you mean {key!r} where the spec has {' and '.join(close)}?" if close else ""
        raise ValueError(
            f"batch[{key!r}] is an integer sequence tensor that no spec field declares, so shard_batch cannot tell "
            f"what to pad it with. Declare it in CPSpec.token_keys (padded with pad_token_id), label_keys "
            f"(ignore_index), position_keys (the count continues), shard_batch's mask_keys= (0), or "
            f"replicated_inputs (not sharded){hint}")

    def is_position(self, key: str) -> bool:
        return key in self.spec.position_keys

    def names(self) -> set[str]:
        """Keys that name sequence tensors: a tensor under one of them must be ``[batch, seq]``-shaped."""
        spec = self.spec
        return {*spec.token_keys, *spec.label_keys, *spec.position_keys, *self.masks, spec.doc_key, "inputs_embeds"}


@dataclass(frozen=True)
class CheckedBatch:
    batch: dict
    """The batch, a one-row position tensor expanded to every row."""
    shape_key: str
    """The key whose tensor gives the rows and the length."""
    rows: int
    seq_len: int
    seq_keys: tuple[str, ...]
    """Keys sharded along the sequence."""
    padding: Padding


def check_batch(batch: dict, spec: CPSpec, mask_keys: tuple[str, ...]) -> CheckedBatch:
    """Refuse a batch whose sequence tensors disagree on rows or length, or that shard_batch cannot pad."""
    if isinstance(mask_keys, str) or not all(isinstance(k, str) for k in mask_keys):
        raise TypeError(f"mask_keys must be a tuple of key names, got {mask_keys!r}")
    packed = any(key in batch for key in LENGTH_KEYS)
    moved = [name for name, _ in spec.sequence_dims if name in spec.position_keys or (
        isinstance(batch.get(name), torch.Tensor) and spec.dim_of(name, batch[name]) != 1)]
    if packed and (spec.seq_dim != 1 or moved):
        raise ValueError(f"packed batches need [batch, seq] tensors (the sequence on dim 1) and write [batch, seq] "
                         f"positions, but spec {spec.name!r} puts the sequence elsewhere for "
                         f"{moved or 'every input'}")
    padding = Padding(spec, MASK_KEYS + tuple(mask_keys), packed)
    found = spec.length_input([(k, v) for k, v in batch.items()
                               if isinstance(v, torch.Tensor) and k not in LENGTH_KEYS],
                              any_rank_tokens=True)
    if found is None:
        raise ValueError(f"shard_batch found no tensor with a sequence dim among {list(batch)}")
    shape_key = found[0]
    _check_dims(shape_key, batch[shape_key], spec.dim_of(*found))
    shape = list(batch[shape_key].shape)
    rows, seq_len = _rows_of(spec, *found), spec.length_of(*found)
    if rows == 0 or seq_len == 0:
        raise ValueError(f"batch[{shape_key!r}] has shape {shape}: no {'rows' if rows == 0 else 'positions'} to shard")
    names = padding.names()
    out, seq_keys = dict(batch), []
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or key in LENGTH_KEYS or not spec.may_shard(key):
            continue
        dim = spec.dim_of(key, value)
        named = (key in names and value.dim() <= dim + 1) or key in (spec.seq_inputs or ())
        if named or (packed and value.dim() == 1 and len(value) == seq_len):
            _check_dims(key, value, dim)
            if value.shape[dim] != seq_len:
                hint = ""
                if key in spec.label_keys:
                    hint = (" (give labels unshifted: shard_batch shifts them inside each document)" if packed
                            else " (shift labels inside the sequence, ending in ignore_index)")
                raise ValueError(f"batch[{key!r}] has length {value.shape[dim]} on dim {dim} but {shape_key} has "
                                 f"{seq_len}: every sequence tensor needs the same length{hint}")
        if not spec.is_sharded(key, value, seq_len, spec.batch_dims(*found), tuple(names)):
            continue
        at = _rows_dim(spec, key, value)
        if at is not None and value.shape[at] != rows:
            if value.shape[at] == 1 and padding.is_position(key):
                value = out[key] = value.expand(*value.shape[:at], rows, *value.shape[at + 1:])
            else:
                one = (": a [1, S] tensor would be broadcast so that every row gets row 0's values"
                       if value.shape[at] == 1 else "")
                raise ValueError(f"batch[{key!r}] has {_rows(value.shape[at])} but {shape_key} has "
                                 f"{_rows(rows)}{one}; give it one row per sequence")
        padding.value(key, value)  # refuses an undeclared integer key even where this batch needs no padding
        seq_keys.append(key)
    return CheckedBatch(out, shape_key, rows, seq_len, tuple(seq_keys), padding)


def _rows_dim(spec: CPSpec, key: str, value: torch.Tensor) -> int | None:
    """The dim of ``value`` that counts rows (sequences): dim 0 (``[batch, ..., seq, ...]``), or the one before
    the sequence for an input ``sequence_dims`` places (M-RoPE's ``[3, batch, seq]``); None when the sequence
    comes first."""
    dim = spec.dim_of(key, value)
    if not dim:
        return None
    return dim - 1 if key in dict(spec.sequence_dims) else 0


def _rows_of(spec: CPSpec, key: str, value: torch.Tensor) -> int:
    at = _rows_dim(spec, key, value)
    return 1 if at is None else value.shape[at]


def _rows(n: int) -> str:
    return f"{n} row" + ("" if n == 1 else "s")


def _check_dims(key: str, value: torch.Tensor, dim: int) -> None:
    if value.dim() <= dim:
        expected = "[batch, seq]" if dim == 1 else f"the sequence on dim {dim}"
        raise ValueError(f"batch[{key!r}] has shape {list(value.shape)}, but sequence tensors need {expected}"
                         + (" (one sequence: add a leading batch dim, t[None])" if value.dim() == dim else ""))
