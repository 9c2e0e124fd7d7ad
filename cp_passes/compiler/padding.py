"""Which planned rewrites let a real position read the padding :func:`cp_passes.shard_batch` adds at the end.

Causal attention, causal windows and convolutions, scans and recurrences read earlier positions only, and a
loss that ignores ``ignore_index`` never counts the padded labels: none of them sees end padding. These do:
attention with no mask and not causal (every query reads the padded keys), hand-written attention whose
masks do not show it causal (:attr:`~cp_passes.transports.keys.KeyOperand.reads_later`) with no mask from
the batch's data (``attention_mask``, ``doc_ids``, which shard_batch pads
with 0 and -1), and a mean over the sequence that ignores nothing (it counts the padded rows).
"""

from __future__ import annotations

from ..data.marks import Mark
from ..errors import CPCompileError, op_name, source_line
from ..transports.keys import KeyMask, KeyOperand
from ..transports.reductions import GlobalMean
from .planner import Plan


def pad_readers(plan: Plan) -> list[str]:
    """One line per rewrite of ``plan`` whose op lets a real position read end padding."""
    data_masks = any(isinstance(rw.request, KeyMask) and rw.request.mask.tensor_leaves for _, rw, _ in plan.rewrites)
    found = []
    for node, rw, _ in plan.rewrites:
        what = None
        if rw.rule == "sdpa_full":
            what = "attention with no mask and is_causal=False: every query reads every key"
        elif isinstance(rw.request, KeyOperand) and rw.request.reads_later and not data_masks:
            what = ("attention written by hand that lets a query read later keys, with no mask from attention_mask "
                    "or doc_ids")
        elif isinstance(rw.request, GlobalMean) and rw.request.ignore_index is None:
            what = "a mean over the sequence that ignores no target: it counts the padded rows"
        if what is not None:
            line = f"{op_name(node)} at {source_line(node)}: {what}"
            if line not in found:
                found.append(line)
    return found


def padding_refusal(cut: Mark, readers: list[str], multiple: int) -> CPCompileError:
    """The refusal of a padded batch for a model with ``readers``; ``multiple``: a length shard_batch keeps."""
    listed = "\n".join(f"  - {line}" for line in readers)
    return CPCompileError(
        f"shard_batch padded the sequence from {cut.seq_len} to {cut.padded_len} positions (a multiple of "
        f"{multiple} under the {cut.kind} layout), and the model reads those padded positions from real ones, so "
        f"its results would differ from the single-device model's:\n{listed}\n"
        f"fix: pass sequences whose length is a multiple of {multiple} (then shard_batch adds no padding), or pass "
        f"an attention_mask (shard_batch pads it with 0) that the model applies to its attention")
