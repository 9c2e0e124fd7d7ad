"""Recurrent kernels (``cp_passes::recurrence``): the state flows across ranks by the carry transport."""

from __future__ import annotations

import operator

import torch

from ..kernels import recurrence_op  # noqa: F401  (registers cp_passes::recurrence)
from ..graph.analysis import hint, meta_val
from ..transports.carry import Carry, split_error
from .registry import Rewrite, RuleContext, register_rule


@register_rule(torch.ops.cp_passes.recurrence.default)
def recurrence_rule(ctx: RuleContext):
    kernel, args, initial_state, _, documents, _ = ctx.node.args
    rec = next((r for r in ctx.spec.recurrences if r.kernel == kernel), None)
    if rec is None:
        ctx.refuse(f"it runs the recurrent kernel {kernel}, which this spec does not declare (another cp_compile "
                   f"in this process did)", "declare it in this spec's recurrences too")
    for name, arg in zip(rec.sequence_args, args):
        if ctx.seq_dims(arg) != (rec.seq_dim,):
            ctx.refuse(f"argument {name!r} of the recurrent kernel {rec.kernel} carries the sequence on dims "
                       f"{ctx.seq_dims(arg)}, not on dim {rec.seq_dim} alone",
                       "pass the kernel [batch, seq, ...] tensors, or fix the Recurrence's seq_dim")
    for arg in args[len(rec.sequence_args):]:
        if ctx.is_seq(arg):
            ctx.refuse(f"a tensor argument of the recurrent kernel {rec.kernel} declared in tensor_args "
                       f"{rec.tensor_args} carries the sequence (dims {ctx.seq_dims(arg)})",
                       "declare it among the Recurrence's sequence_args")
    request = Carry(ctx.node, rec)
    if rec.form == "affine" and request.value_axis not in (-1, -2):
        ctx.refuse(f"the affine carry of {rec.kernel} extends its value {rec.value_arg!r} by K columns, but no single "
                   f"one of the state's last two axes {tuple(request.state.shape)} grows with it",
                   "name the argument whose last dim is the state's V in value_arg, or declare form='sequential' "
                   "(any state; P kernel calls per rank)")
    if documents is None:
        _check_declaration(ctx, rec, request)
    if initial_state is not None and ctx.is_seq(initial_state):
        ctx.refuse("its initial state is sharded along the sequence", "pass one state for the whole sequence")
    if documents is not None and ctx.is_seq(documents):
        ctx.refuse(f"its document boundaries {rec.documents!r} are sharded along the sequence",
                   "pass the whole sequence's cu_seqlens (every rank holds them; cp_passes cuts each rank's "
                   "segments)")
    request.final_read = any(user.target is operator.getitem and user.args[1] == 1 and user.users
                             for user in ctx.node.users)
    how = {"affine": "every rank's [h | M] gathered and folded; the kernel runs twice per rank, once on K more value "
                     "columns, ranks in parallel",
           "selective": "every rank's final state and decay gathered and folded, the state's part added to the "
                        "output; one kernel call per rank, ranks in parallel"}.get(
        rec.form, f"{ctx.world - 1} rounds of handing final states on; {ctx.world} kernel calls per rank, serial")
    read = ("; the final state it returns is the last rank's, the sequence's, on every rank (one all-gather)"
            if request.final_read else "")
    return Rewrite(f"carry_{rec.form}", "carry", request,
                   note=f"{rec.kernel.split(':')[-1]}: each rank starts from the state its predecessors leave "
                        f"({how}){read}")


_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4}
"""Of a split's difference from the whole sequence, relative to its largest value (half types: 2e-2)."""


def _check_declaration(ctx: RuleContext, rec, request: Carry) -> None:
    """Refuse a kernel that does not compose as its Recurrence says (a right-to-left scan, a state through a
    tanh declared affine): the carry's algorithm, run on random inputs cut in two, must give the whole's outputs
    and final state."""
    kernel, args, _, options, _, _ = ctx.node.args
    args = [meta_val(a) for a in args]
    local = hint(args[0].shape[rec.seq_dim])
    error = split_error(kernel, rec, args, options, request.state, request.value_axis,
                        tuple(dict.fromkeys((16, local - local % 2))))
    tolerance = _TOLERANCE.get(request.state.dtype, 2e-2)
    if error is not None and error > tolerance:
        how = {"affine": "the fold of each half's [h | M] (the state's affine map)",
               "selective": "the first half's final state (its decay applied to the state, plus its own)"}.get(
            rec.form, "the first half's final state")
        ctx.refuse(f"the recurrent kernel {rec.kernel} does not compose as its Recurrence(form={rec.form!r}) declares: "
                   f"on random inputs cut in two, the second half run from {how} differs from the whole sequence by "
                   f"{error:.2g} of its largest value (outputs or final state)",
                   "declare a kernel that scans the sequence left to right, with form='affine' only where the final "
                   "state is an affine map of the initial one (linear attention, the delta rule, Mamba-2), "
                   "form='sequential' for any other state; or keep the kernel outside the compiled module")
