"""Packed documents (THD batches): one global document-id map, per-document positions and labels.

Rows arrive packed with per-document lengths, as ``seq_lens`` / ``seq_lens_padded`` ``[batch, docs]``
(unused slots -1000) or ``cu_seqlens`` ``[docs + 1]`` (one row). Everything here runs on the global
row, before sharding, so every rank derives the same map; validity comes from the lengths, never from
token ids (an EOS that equals the pad id stays valid).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

UNUSED_SLOT = -1000
"""Marks an unused document slot in ``seq_lens`` / ``seq_lens_padded``."""
PAD_DOC_ID = -1
"""Document id of padding positions: never equal to a real document's id."""
LENGTH_KEYS = ("seq_lens", "seq_lens_padded", "cu_seqlens", "cu_seqlens_padded")


@dataclass(frozen=True)
class Document:
    start: int
    length: int
    """Real tokens."""
    slot: int
    """Positions the document occupies, its padding included (>= length)."""


def _row_documents(batch: dict, rows: int, seq_len: int) -> list[list[Document]]:
    if "cu_seqlens" in batch:
        cu = torch.as_tensor(batch["cu_seqlens"]).reshape(-1, torch.as_tensor(batch["cu_seqlens"]).shape[-1])
        cu_padded = torch.as_tensor(batch.get("cu_seqlens_padded", cu)).reshape(cu.shape)
        lens, padded = cu.diff(dim=-1), cu_padded.diff(dim=-1)
    elif "seq_lens" in batch:
        lens = torch.as_tensor(batch["seq_lens"]).reshape(rows, -1)
        padded = torch.as_tensor(batch.get("seq_lens_padded", lens)).reshape(lens.shape)
    else:
        raise ValueError("a packed batch needs seq_lens (and optionally seq_lens_padded) or cu_seqlens")
    if lens.shape[0] != rows:
        raise ValueError(f"document lengths describe {lens.shape[0]} rows, but the batch has {rows}")
    out = []
    for row in range(rows):
        docs, start = [], 0
        for d, (n, s) in enumerate(zip(lens[row].tolist(), padded[row].tolist())):
            if n == UNUSED_SLOT and s == UNUSED_SLOT:
                continue
            if n < 0 or s < 0:
                raise ValueError(f"row {row}, document {d}: negative length {n} (padded {s}); unused slots are "
                                 f"{UNUSED_SLOT} in both seq_lens and seq_lens_padded")
            if s < n:
                raise ValueError(f"row {row}, document {d}: padded length {s} is shorter than its length {n}")
            docs.append(Document(start, n, s))
            start += s
        if start != seq_len:
            raise ValueError(f"row {row}: document lengths sum to {start}, but the row has {seq_len} positions")
        out.append(docs)
    return out


def _aligned(docs: list[Document], alignment: int) -> tuple[list[Document], list[int]]:
    """Move each document to start at a multiple of ``alignment``; returns the new documents and, for
    every new position, the old position it holds (-1 for inserted padding)."""
    new_docs, source, cursor = [], [], 0
    for doc in docs:
        slot = -(-doc.slot // alignment) * alignment
        new_docs.append(Document(cursor, doc.length, slot))
        source.extend(range(doc.start, doc.start + doc.slot))
        source.extend([-1] * (slot - doc.slot))
        cursor += slot
    return new_docs, source


def pack(batch: dict, seq_dim: int, ignore_index: int, pad_token_id: int, label_keys, position_keys,
         packed_alignment: int = 1) -> dict:
    """The global packed batch: sequence tensors re-laid for ``packed_alignment``, and ``doc_ids``,
    per-document ``position_ids``, ``valid`` and (from unshifted ``labels``) ``shift_labels`` added.

    Raises ValueError naming the row and the document for lengths that do not describe the row and for
    given positions that jump inside a document or do not restart at zero.
    """
    if seq_dim != 1:
        raise ValueError(f"packed batches need [batch, seq] tensors (seq_dim 1), got seq_dim {seq_dim}")
    ids = batch["input_ids"]
    rows, seq_len = ids.shape[0], ids.shape[1]
    documents = _row_documents(batch, rows, seq_len)
    sources = None
    if packed_alignment > 1:
        aligned = [_aligned(docs, packed_alignment) for docs in documents]
        documents = [docs for docs, _ in aligned]
        width = max(len(src) for _, src in aligned)
        sources = torch.tensor([src + [-1] * (width - len(src)) for _, src in aligned])
        for row, docs in enumerate(documents):
            tail = width - (docs[-1].start + docs[-1].slot if docs else 0)
            if tail:
                documents[row] = docs + [Document(width - tail, 0, tail)]
        seq_len = width
    doc_ids = torch.full((rows, seq_len), PAD_DOC_ID, dtype=torch.long)
    positions = torch.zeros((rows, seq_len), dtype=torch.long)
    for row, docs in enumerate(documents):
        for d, doc in enumerate(docs):
            doc_ids[row, doc.start:doc.start + doc.length] = d
            positions[row, doc.start:doc.start + doc.length] = torch.arange(doc.length)
    valid = doc_ids != PAD_DOC_ID

    out = {}
    for key, value in batch.items():
        if key in LENGTH_KEYS:
            continue
        if isinstance(value, torch.Tensor) and value.dim() > 1 and value.shape[:2] == ids.shape[:2]:
            if sources is not None:
                fill = ignore_index if key in label_keys else (0 if key not in ("input_ids",) else pad_token_id)
                gathered = value.gather(1, sources.clamp(min=0).view(rows, -1, *[1] * (value.dim() - 2))
                                        .expand(rows, seq_len, *value.shape[2:]))
                mask = (sources >= 0).view(rows, -1, *[1] * (value.dim() - 2))
                value = torch.where(mask, gathered, torch.full_like(gathered, fill))
            if key in position_keys:
                _validate_positions(value, documents, key)
                value = positions.to(value.dtype)
        out[key] = value
    out["doc_ids"] = doc_ids
    out.setdefault("position_ids", positions)
    if "labels" in out and "shift_labels" not in out:
        labels = out["labels"]
        nxt = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], ignore_index)], dim=1)
        same_doc = torch.cat([doc_ids[:, 1:] == doc_ids[:, :-1], torch.zeros_like(valid[:, :1])], dim=1)
        keep = same_doc & valid & torch.cat([valid[:, 1:], torch.zeros_like(valid[:, :1])], dim=1)
        if "loss_mask" in out:
            lm = out["loss_mask"].bool()
            keep &= torch.cat([lm[:, 1:], torch.zeros_like(lm[:, :1])], dim=1)
        out["shift_labels"] = torch.where(keep, nxt, torch.full_like(nxt, ignore_index))
    out["valid"] = valid
    return out


def _validate_positions(positions: torch.Tensor, documents: list[list[Document]], key: str) -> None:
    for row, docs in enumerate(documents):
        for d, doc in enumerate(docs):
            got = positions[row, doc.start:doc.start + doc.length]
            if doc.length and int(got[0]) != 0:
                raise ValueError(f"{key}: row {row}, document {d} starts at position {int(got[0])}, not 0")
            steps = got.diff()
            if bool((steps != 1).any()):
                i = int((steps != 1).nonzero()[0]) + 1
                raise ValueError(f"{key}: row {row}, document {d} jumps from position {int(got[i - 1])} to "
                                 f"{int(got[i])} at its token {i} (positions must rise by 1 inside a document)")
