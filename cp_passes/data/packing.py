"""Packed documents (THD batches): one global document-id map, per-document positions and labels.

Rows arrive packed with per-document lengths, as ``seq_lens`` / ``seq_lens_padded`` ``[batch, docs]``
(unused slots -1000) or ``cu_seqlens`` / ``cu_seqlens_padded`` offsets ``[batch, docs + 1]`` (1-D for one
row), from 0 to the row length. Everything here runs on the global row, before sharding, so every rank
derives the same map; validity comes from the lengths, never from token ids (an EOS that equals the pad
id stays valid).
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
    for form in ("seq_lens", "cu_seqlens"):
        if f"{form}_padded" in batch and form not in batch:
            raise ValueError(f"{form}_padded needs {form} (the real lengths) next to it")
    forms = [form for form in ("seq_lens", "cu_seqlens") if form in batch]
    documents = [_documents(*_lengths(batch, form, rows, seq_len), seq_len, form) for form in forms]
    if len(documents) == 2:
        for row, (a, b) in enumerate(zip(*documents)):
            a, b = ([(d.start, d.length, d.slot) for d in docs if d.slot] for docs in (a, b))
            if a != b:
                raise ValueError(f"row {row}: seq_lens give the documents {a} but cu_seqlens give {b} (as (start, "
                                 f"length, padded length)); give one form of the lengths, or make the two agree")
    return documents[0]


def _lengths(batch: dict, form: str, rows: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[rows, docs]`` lengths and padded lengths from ``seq_lens`` or ``cu_seqlens`` (and their ``_padded``)."""
    real = _as_table(batch, form, rows)
    padded = _as_table(batch, f"{form}_padded", rows, real) if f"{form}_padded" in batch else real
    if form == "seq_lens":
        return real, padded
    keys = [key for key in (form, f"{form}_padded") if key in batch]
    for key, offsets in zip(keys, (real, padded)):
        if offsets.shape[1] == 0:
            raise ValueError(f"{key} is empty: each row needs its document offsets from 0 to the row length")
        for row, first in enumerate(offsets[:, 0].tolist()):
            if first != 0:
                raise ValueError(f"{key}: row {row} starts at {first}; document offsets start at 0")
        down = (offsets.diff(dim=1) < 0).nonzero()
        if len(down):
            row, d = down[0].tolist()
            raise ValueError(f"{key}: row {row} falls from {int(offsets[row, d])} to {int(offsets[row, d + 1])} "
                             f"at document {d}; offsets must not decrease")
    for row, last in enumerate(padded[:, -1].tolist()):
        if last != seq_len:
            raise ValueError(f"{keys[-1]}: row {row} ends at {last}, but the row has {seq_len} positions")
    return real.diff(dim=1), padded.diff(dim=1)


def _as_table(batch: dict, key: str, rows: int, like: torch.Tensor | None = None) -> torch.Tensor:
    """``batch[key]`` as an integer ``[rows, n]`` tensor (a 1-D one for a one-row batch)."""
    fill = UNUSED_SLOT if key.startswith("seq_lens") else "the last offset"
    try:
        table = torch.as_tensor(batch[key])
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{key} must be a tensor or equal-length lists of ints ({e}); fill the short rows "
                         f"with {fill}") from None
    if table.numel() and (table.dtype == torch.bool or table.is_floating_point() or table.is_complex()):
        raise TypeError(f"{key} must hold integers, got {table.dtype}")
    if table.dim() == 1 and rows == 1:
        table = table[None]
    width = "docs" if key.startswith("seq_lens") else "docs + 1"
    if table.dim() != 2 or table.shape[0] != rows:
        one_row = " (a 1-D one describes a single row)" if table.dim() == 1 else ""
        raise ValueError(f"{key} has shape {list(table.shape)}, but a batch of {rows} rows needs [{rows}, {width}]"
                         f"{one_row}; fill the unused slots of short rows with {fill}")
    if like is not None and table.shape != like.shape:
        real = key.removesuffix("_padded")
        raise ValueError(f"{key} has shape {list(table.shape)} but {real} has {list(like.shape)}; "
                         f"they must match slot for slot")
    return table


def _documents(lens: torch.Tensor, padded: torch.Tensor, seq_len: int, form: str) -> list[list[Document]]:
    out = []
    for row in range(lens.shape[0]):
        docs, start = [], 0
        for d, (n, s) in enumerate(zip(lens[row].tolist(), padded[row].tolist())):
            if n == UNUSED_SLOT and s == UNUSED_SLOT:
                continue
            if n < 0 or s < 0:
                raise ValueError(f"{form}: row {row}, document {d}: negative length {n} (padded {s}); unused slots "
                                 f"are {UNUSED_SLOT} in both seq_lens and seq_lens_padded")
            if s < n:
                raise ValueError(f"{form}: row {row}, document {d}: padded length {s} is shorter than its length {n}")
            docs.append(Document(start, n, s))
            start += s
        if start != seq_len:
            raise ValueError(f"{form}: row {row}: document lengths sum to {start}, but the row has {seq_len} positions")
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


def pack(checked, packed_alignment: int = 1, pieces: int = 1) -> dict:
    """The global packed batch from ``checked`` (a :class:`~cp_passes.data.checks.CheckedBatch`): sequence
    tensors re-laid for ``packed_alignment``, and ``valid``, the document-id map (``spec.doc_key``),
    per-document positions (``spec.position_keys[0]``) and labels shifted inside each document
    (``spec.packed_labels``: read unshifted from the first key, written to the second) added.

    ``pieces > 1`` (``packed_alignment`` a multiple of it) then interleaves every row's documents
    (:func:`interleaved_order`): each document cut into ``pieces`` equal pieces, the row holding every
    document's first piece, then every second piece, and so on, each document's positions still in order;
    ``order`` (``[rows, length]``) then says which position of the packed row each position holds. Labels
    (``spec.label_keys`` and ``spec.packed_labels``) then hold ``spec.ignore_index`` on every padding row, and the
    rows must share one order (the same document lengths).

    Raises ValueError naming the row and the document for lengths that do not describe the row and for
    given positions that jump inside a document or do not restart at zero.
    """
    batch, rows, seq_len, padding = checked.batch, checked.rows, checked.seq_len, checked.padding
    documents = _row_documents(batch, rows, seq_len)
    for key in checked.seq_keys:
        if padding.is_position(key):
            _validate_positions(batch[key], documents, key)
    if pieces > 1 and packed_alignment % pieces:
        raise ValueError(f"interleaving documents in {pieces} pieces needs them aligned to a multiple of {pieces}, "
                         f"got packed_alignment={packed_alignment}")
    sources = None
    if packed_alignment > 1:
        documents, sources, seq_len = _aligned_rows(documents, packed_alignment)
    doc_ids, positions = _document_maps(documents, rows, seq_len)
    valid = doc_ids != PAD_DOC_ID
    out = _relaid(checked, positions, sources, seq_len)
    spec = padding.spec
    if not spec.position_keys:
        raise ValueError(f"packing writes per-document positions under CPSpec.position_keys[0], but spec "
                         f"{spec.name!r} has position_keys=(); name the key the model takes positions under")
    (labels_key, shifted_key), position_key = spec.packed_labels, spec.position_keys[0]
    out[spec.doc_key] = doc_ids
    out.setdefault(position_key, positions)
    if labels_key in checked.seq_keys and shifted_key not in out:
        loss_mask = out["loss_mask"] if "loss_mask" in checked.seq_keys else None
        out[shifted_key] = _shifted_labels(out[labels_key], doc_ids, valid, loss_mask, spec.ignore_index)
    out["valid"] = valid
    if pieces > 1:
        _interleave(out, checked, documents, seq_len, pieces)
    return out


def _aligned_rows(documents: list[list[Document]], alignment: int) -> tuple[list[list[Document]], torch.Tensor, int]:
    """Every row's documents moved to start at multiples of ``alignment`` (:func:`_aligned`), the rows padded to
    the longest, each row's tail after its last document a document of length 0: the new documents, ``sources``
    (``[rows, width]``: the old position each new one holds, -1 for padding) and the new row length ``width``."""
    aligned = [_aligned(docs, alignment) for docs in documents]
    documents = [docs for docs, _ in aligned]
    width = max(len(src) for _, src in aligned)
    sources = torch.tensor([src + [-1] * (width - len(src)) for _, src in aligned])
    for row, docs in enumerate(documents):
        tail = width - (docs[-1].start + docs[-1].slot if docs else 0)
        if tail:
            documents[row] = docs + [Document(width - tail, 0, tail)]
    return documents, sources, width


def _document_maps(documents: list[list[Document]], rows: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(doc_ids, positions)``, both ``[rows, seq_len]``: each position's document index (``PAD_DOC_ID`` on
    padding) and its position within its document (0 on padding)."""
    doc_ids = torch.full((rows, seq_len), PAD_DOC_ID, dtype=torch.long)
    positions = torch.zeros((rows, seq_len), dtype=torch.long)
    for row, docs in enumerate(documents):
        for d, doc in enumerate(docs):
            doc_ids[row, doc.start:doc.start + doc.length] = d
            positions[row, doc.start:doc.start + doc.length] = torch.arange(doc.length)
    return doc_ids, positions


def _relaid(checked, positions: torch.Tensor, sources: torch.Tensor | None, seq_len: int) -> dict:
    """The batch without its length keys: position keys replaced by ``positions``, and, where documents moved
    (``sources``), every other sequence tensor re-laid with its padding value in the gaps."""
    batch, rows, padding = checked.batch, checked.rows, checked.padding
    out = {}
    for key, value in batch.items():
        if key in LENGTH_KEYS:
            continue
        if key in checked.seq_keys:
            if padding.is_position(key):
                value = positions.to(value.dtype)
            elif sources is not None:
                gathered = value.gather(1, sources.clamp(min=0).view(rows, -1, *[1] * (value.dim() - 2))
                                        .expand(rows, seq_len, *value.shape[2:]))
                mask = (sources >= 0).view(rows, -1, *[1] * (value.dim() - 2))
                value = torch.where(mask, gathered, torch.full_like(gathered, padding.value(key, value)))
        out[key] = value
    return out


def _shifted_labels(labels: torch.Tensor, doc_ids: torch.Tensor, valid: torch.Tensor,
                    loss_mask: torch.Tensor | None, ignore_index: int) -> torch.Tensor:
    """Labels shifted by one inside each document: the next position's label where it is in the same document,
    valid, and (with a ``loss_mask``) counted; ``ignore_index`` elsewhere."""
    nxt = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], ignore_index)], dim=1)
    same_doc = torch.cat([doc_ids[:, 1:] == doc_ids[:, :-1], torch.zeros_like(valid[:, :1])], dim=1)
    keep = same_doc & valid & torch.cat([valid[:, 1:], torch.zeros_like(valid[:, :1])], dim=1)
    if loss_mask is not None:
        lm = loss_mask.bool()
        keep &= torch.cat([lm[:, 1:], torch.zeros_like(lm[:, :1])], dim=1)
    return torch.where(keep, nxt, torch.full_like(nxt, ignore_index))


def _interleave(out: dict, checked, documents: list[list[Document]], seq_len: int, pieces: int) -> None:
    """Reorder ``out``'s sequence tensors in place by :func:`interleaved_order` and add it as ``order``; labels
    get ``ignore_index`` on padding rows first. Raises ValueError where rows' documents differ in length."""
    batch, rows, spec, valid = checked.batch, checked.rows, checked.padding.spec, out["valid"]
    for key in {*spec.label_keys, *spec.packed_labels} & set(out):  # padding rows: no target
        out[key] = torch.where(valid, out[key], torch.full_like(out[key], spec.ignore_index))
    order = torch.stack([interleaved_order(docs, seq_len, pieces) for docs in documents])
    if any(not torch.equal(row, order[0]) for row in order[1:]):
        raise ValueError("balance='documents' orders a row by its own documents, and these rows' documents "
                         "differ in length: an op across the batch would then mix rows ordered differently. "
                         "Pass one packed row per batch (or rows whose documents have the same lengths)")
    for key, value in out.items():
        if key in checked.seq_keys or key not in batch:
            out[key] = value.gather(1, order.view(rows, -1, *[1] * (value.dim() - 2))
                                    .expand(rows, seq_len, *value.shape[2:]))
    out["order"] = order


def interleaved_order(docs: list[Document], seq_len: int, pieces: int) -> torch.Tensor:
    """The order that interleaves a row's documents (each ``slot`` a multiple of ``pieces``; the row's tail after
    the last one a document too): for ``j`` in ``0 .. pieces - 1``, the ``j``-th ``1 / pieces`` of every
    document in turn. Every ``1 / pieces`` of the new row then holds one piece of every document, so the balanced
    layout's chunks ``r`` and ``2P - 1 - r`` (``pieces = 2P``) give rank ``r`` a head and a tail of each document:
    causal work per document, and so per row, the same on every rank. Within a document the order is kept."""
    spans = [(doc.start, doc.slot) for doc in docs if doc.slot]
    end = spans[-1][0] + spans[-1][1] if spans else 0
    if end < seq_len:
        spans.append((end, seq_len - end))
    return torch.cat([torch.arange(start + j * (slot // pieces), start + (j + 1) * (slot // pieces))
                      for j in range(pieces) for start, slot in spans])


def _validate_positions(positions: torch.Tensor, documents: list[list[Document]], key: str) -> None:
    # a one-row tensor expanded to every row (stride 0) must restart at every document of every row
    shared = " (its one row is used for every row)" if len(documents) > 1 and positions.stride(0) == 0 else ""
    for row, docs in enumerate(documents):
        for d, doc in enumerate(docs):
            got = positions[row, doc.start:doc.start + doc.length]
            if doc.length and int(got[0]) != 0:
                raise ValueError(f"{key}: row {row}, document {d} starts at position {int(got[0])}, not 0{shared}")
            steps = got.diff()
            if bool((steps != 1).any()):
                i = int((steps != 1).nonzero()[0]) + 1
                raise ValueError(f"{key}: row {row}, document {d} jumps from position {int(got[i - 1])} to "
                                 f"{int(got[i])} at its token {i} (positions must rise by 1 inside a document)"
                                 f"{shared}")
