"""Which planned rewrites let a real position read the padding :func:`cp_passes.shard_batch` adds at the end.

Causal attention, causal windows and convolutions, scans, recurrences and shifts that read earlier rows read
earlier positions only, and a loss that ignores ``ignore_index`` never counts the padded labels: none of them
sees end padding. These do: attention with no mask and not causal (every query reads the padded keys), or
with a bidirectional mask built from positions alone,
hand-written attention whose masks do not show it causal (:attr:`~cp_passes.transports.keys.KeyOperand.reads_later`)
with no mask from the batch's data (``attention_mask``, ``doc_ids``, which shard_batch pads with 0 and -1), a
shift that reads later rows (the last real rows read the padding in place of the shift's fill) unless it reads
an input shard_batch pads with that fill (labels shifted with ``ignore_index``), a mean over the sequence that
ignores nothing, a sum over the sequence returned as this rank's share or read whole (it adds the padded rows)
unless it is a loss that ignores the padded labels or a count of a mask, a division by a row count, and a table
sliced from its end by the sequence length (``table[n - S:]``), a row picked from the end (``hidden[:, -1]``), and
a max, min, any or all over the sequence or the position of one (padded positions continue the count).
"""

from __future__ import annotations

import torch

from ..data.marks import Mark
from ..errors import CPCompileError, op_name, source_line
from ..graph.analysis import INPUT_NAME, bind_args, meta_val
from ..spec import CPSpec
from ..transports.carry import Carry
from ..transports.keys import KeyMask, KeyOperand
from ..transports.picks import GlobalArgExtreme, Pick
from ..transports.positions import TableRows
from ..transports.reductions import GlobalExtreme, GlobalMean, GlobalSum
from ..transports.shift import Shift
from .planner import Plan

aten = torch.ops.aten

_COPIES = {aten._to_copy.default, aten.to.dtype, aten.to.device, aten.to.dtype_layout, aten.clone.default,
           aten.contiguous.default, aten.alias.default, aten.detach.default}
_IGNORING_LOSSES = (aten.cross_entropy_loss, aten.nll_loss, aten.nll_loss_nd, aten.nll_loss2d)


def end_fill(node: torch.fx.Node, spec: CPSpec):
    """What shard_batch pads the input ``node`` reads (through copies) with; None if not an input or unknown."""
    while node.target in _COPIES:
        node = node.args[0]
    name = node.meta.get(INPUT_NAME) if node.op == "placeholder" else None
    if name is None:
        return None
    if name in spec.label_keys or name == spec.packed_labels[1]:
        return spec.ignore_index
    if name in spec.token_keys:
        return spec.pad_token_id
    if name == spec.doc_key:
        return -1
    if name in spec.position_keys:
        return None
    val = meta_val(node)
    return 0 if val.dtype == torch.bool or val.is_floating_point() else None


def ignores_padding(origin: torch.fx.Node, spec: CPSpec) -> bool:
    """A summed loss that gives the padded labels (``spec.ignore_index``) nothing."""
    if getattr(origin.target, "overloadpacket", None) not in _IGNORING_LOSSES:
        return False
    return bind_args(origin).get("ignore_index", -100) == spec.ignore_index


def _counts_a_mask(origin: torch.fx.Node | None) -> bool:
    """A sum of a boolean tensor (how many image tokens a mask holds): the padding's rows hold False."""
    return (origin is not None and getattr(origin.target, "overloadpacket", None) is aten.sum
            and meta_val(origin.args[0]).dtype == torch.bool)


def sum_sources(plan: Plan, request: GlobalSum) -> frozenset:
    """Every op whose sum over the sequence ``request`` reads (a sum of several losses: each of them)."""
    return frozenset().union(*(plan.partial_sources.get(t, frozenset()) for t in request.partial)) \
        or frozenset({request.origin})


def partial_output_sources(plan: Plan) -> frozenset:
    """Every op whose sum over the sequence a partial output adds up."""
    return frozenset().union(*(plan.partial_sources.get(p.value, frozenset({p.value})) for p in plan.partial_outputs))


def pad_readers(plan: Plan, spec: CPSpec) -> list[str]:
    """One line per rewrite of ``plan`` whose op lets a real position read end padding."""
    data_masks = any(isinstance(rw.request, KeyMask) and rw.request.mask.tensor_leaves for _, rw, _ in plan.rewrites)
    found = []
    reads = [(node, rw.rule, rw.request) for node, rw, _ in plan.rewrites]
    reads += [(origin, "partial_sum", None) for origin in partial_output_sources(plan)]
    for node, rule, request in reads:
        what = None
        if rule == "partial_sum" and not ignores_padding(node, spec):
            what = "a sum over the sequence returned as this rank's share: it adds the padded rows"
        elif isinstance(request, Shift) and request.offset > 0 and end_fill(request.source, spec) != request.fill:
            what = (f"a shift that reads {request.offset} row(s) later: the last real rows read the padding in "
                    f"place of the fill {request.fill}")
        elif rule == "sdpa_full":
            what = "attention with no mask and is_causal=False: every query reads every key"
        elif rule.startswith("sdpa_bidirectional") and (request.mask is None or not request.mask.tensor_leaves):
            what = "bidirectional attention with a mask from positions alone: queries read the padded keys"
        elif isinstance(request, KeyOperand) and request.reads_later and not data_masks:
            what = ("attention written by hand that lets a query read later keys, with no mask from attention_mask "
                    "or doc_ids")
        elif isinstance(request, GlobalMean) and request.ignore_index is None:
            what = "a mean over the sequence that ignores no target: it counts the padded rows"
        elif isinstance(request, TableRows) and request.per_length:
            what = ("a table sliced from its end by the sequence length: the padded length moves every row it "
                    "reads")
        elif isinstance(request, GlobalExtreme):
            what = f"a {request.op} over the sequence read as a whole: it reads the padded rows"
        elif isinstance(request, GlobalArgExtreme):
            what = f"the position of the {request.op} over the sequence: it reads the padded rows"
        elif isinstance(request, Pick) and request.from_end:
            what = ("a row counted from the end of the sequence: the padded length moves it" if request.kind == "select"
                    else "rows picked by an index tensor: a negative index counts from the padded end")
        elif isinstance(request, Carry) and request.final_read:
            what = "a recurrence's final state read as the sequence's: it runs through the padded rows"
        elif isinstance(request, GlobalSum) and request.lengths:
            what = "a division by a row count from the sequence length: it counts the padded rows"
        elif isinstance(request, GlobalSum) and not all(_counts_a_mask(o) or ignores_padding(o, spec)
                                                        for o in sum_sources(plan, request)):
            what = "a sum over the sequence read as a whole (all-reduced): it adds the padded rows"
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
