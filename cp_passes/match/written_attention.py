"""SDPA written out as the attention it computes, where its mask or its keys are no cut of positions.

- A float mask that adds a bias: ``attn_mask=bias`` built from positions, mixing ``-inf`` with finite values
  (ALiBi's ``slope * (j - i)`` with the later keys masked), is no mask the attention rule can cut into allowed
  and disallowed pairs: it changes the scores. Written out, ``softmax(q @ k^T * scale + bias) @ v`` is the form
  hand-written attention has, which the key rules read (the keys brought, the bias evaluated at this rank's rows
  and those keys); a row that sees no key is 0, as SDPA answers. A mask of 0 and ``-inf`` only stays on SDPA;
  so do masks from data, learned biases and attention with dropout, which the attention rule decides about.
- Memory keys: ``k = cat([mem_k, k], -2)`` (and ``v`` so) with ``mem_k`` held whole on every rank (learned
  memory tokens, a sink) puts keys that are no position in front of the sequence's. Written out over the two
  parts, every query reads the memory's scores locally and the sequence's keys as hand-written attention does,
  and one softmax runs over both: ``m = max(max(s_mem), max(s_seq))``, ``(e^(s_mem - m) @ mem_v + e^(s_seq - m)
  @ v) / (sum e^(s_mem - m) + sum e^(s_seq - m))`` (``m`` the shift only, without a gradient; a row that sees no
  key is 0, as SDPA answers), the mask taken apart where it is built as the two
  parts (``cat([mem_mask, mask], -1)``, ``F.pad(mask, (M, 0), value=True)``).
"""

from __future__ import annotations

import math

import torch
import torch.fx

from ..graph.analysis import bind_args, hint, meta_val, seq_dims
from ..graph.emit import emit
from ..transports.masks import MetadataMask
from .masks import PositionMask, evaluate_position_mask, may_carry_gradient, model_mask

aten = torch.ops.aten


def _adds_a_bias(mask: torch.fx.Node, sym, multiple: int, length: int) -> bool:
    """Whether ``mask`` is built from positions alone and, at ``length``, holds a finite value other than 0; or is
    a bias learned from positions (it carries a gradient to parameters alone: a relative-position table)."""
    carry = may_carry_gradient(mask.graph)
    found = model_mask(mask, sym, carry, multiple=multiple, learned=True)
    if mask in carry:
        return isinstance(found, MetadataMask)
    if not isinstance(found, PositionMask):
        return False
    try:
        value = evaluate_position_mask(found, sym, length)
    except Exception:  # noqa: BLE001 - a mask that does not evaluate stays with the attention rule
        return False
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return False
    finite = torch.isfinite(value) & (value > torch.finfo(value.dtype).min)
    return bool(((value != 0) & finite).any())


def _plain(args: dict) -> bool:
    """No dropout and no ``is_causal``: the written-out form computes the same."""
    return args.get("dropout_p", 0.0) == 0.0 and not args.get("is_causal", False)


def _scores(graph, node, q, k, scale, mask):
    """``q @ k^T * scale`` with ``mask`` added (a float mask) or applied (a boolean one)."""
    scores = emit(graph, node, aten.matmul.default, (q, emit(graph, node, aten.transpose.int, (k, -2, -1))))
    scores = emit(graph, node, aten.mul.Tensor, (scores, scale))
    if mask is None:
        return scores
    if meta_val(mask).dtype == torch.bool:
        hidden = emit(graph, node, aten.logical_not.default, (mask,))
        return emit(graph, node, aten.masked_fill.Scalar, (scores, hidden, -math.inf))
    return emit(graph, node, aten.add.Tensor, (scores, mask))


def _hidden_rows(graph, node, scores):
    """Which query rows see no key (every score ``-inf``): SDPA answers 0 there, a softmax NaN."""
    return emit(graph, node, aten.all.dim, (emit(graph, node, aten.eq.Scalar, (scores, -math.inf)), -1, True))


def _operands(graph, node, args: dict):
    """``(q, k, v, scale)``, K and V repeated to the query heads under ``enable_gqa``."""
    q, k, v = args["query"], args["key"], args["value"]
    scale = args.get("scale")
    scale = 1 / math.sqrt(hint(meta_val(q).shape[-1])) if scale is None else scale
    groups = hint(meta_val(q).shape[-3]) // hint(meta_val(k).shape[-3]) if meta_val(q).dim() >= 3 else 1
    if args.get("enable_gqa", False) and groups > 1:
        k = emit(graph, node, aten.repeat_interleave.self_int, (k, groups, -3))
        v = emit(graph, node, aten.repeat_interleave.self_int, (v, groups, -3))
    return q, k, v, scale


def _replace(gm: torch.fx.GraphModule, node: torch.fx.Node, out: torch.fx.Node) -> None:
    """``out`` in ``node``'s place; what only ``node`` read (the concatenated keys) goes with it."""
    node.replace_all_uses_with(out)
    stack = [node]
    while stack:
        dead = stack.pop()
        if dead.users or dead.op != "call_function" or dead.target._schema.is_mutable:
            continue
        inputs = dead.all_input_nodes
        gm.graph.erase_node(dead)
        stack.extend(inputs)


def _each_sdpa(gm: torch.fx.GraphModule, write) -> int:
    """``write(node, args)`` for each SDPA without dropout or ``is_causal``, at the node: the written-out output,
    or None (it emits nothing then); each output replaces its SDPA. Returns how many were written out."""
    rewritten = 0
    for node in list(gm.graph.find_nodes(op="call_function", target=aten.scaled_dot_product_attention.default)):
        args = bind_args(node)
        if not _plain(args):
            continue
        with gm.graph.inserting_before(node):
            out = write(node, args)
        if out is not None:
            _replace(gm, node, out)
            rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


def biased_sdpa_as_scores(gm: torch.fx.GraphModule, sym, multiple: int = 1) -> int:
    """Write out each SDPA whose float mask adds a bias (see the module doc); returns how many."""

    def write(node, args):
        mask = args.get("attn_mask")
        if not isinstance(mask, torch.fx.Node) or not meta_val(mask).is_floating_point() \
                or not _adds_a_bias(mask, sym, multiple, hint(meta_val(args["query"]).shape[-2])):
            return None
        graph = node.graph
        q, k, v, scale = _operands(graph, node, args)
        scores = _scores(graph, node, q, k, scale, mask)
        hidden = _hidden_rows(graph, node, scores)
        scores = emit(graph, node, aten.where.ScalarSelf, (hidden, 0.0, scores))
        probs = emit(graph, node, aten.softmax.int, (scores, -1))
        probs = emit(graph, node, aten.where.ScalarSelf, (hidden, 0.0, probs))
        return emit(graph, node, aten.matmul.default, (probs, v))

    return _each_sdpa(gm, write)


def _memory_split(node, sym) -> tuple[torch.fx.Node, torch.fx.Node, bool] | None:
    """``(whole part, sequence part, whole first)`` of ``cat([mem, x], -2)`` (or ``[x, mem]``): one part held
    whole on every rank with a static length, the other the sequence along the concatenated dim; else None."""
    if not isinstance(node, torch.fx.Node) or node.target is not aten.cat.default or len(node.args[0]) != 2:
        return None
    ndim = meta_val(node).dim()
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % ndim
    a, b = node.args[0]
    if dim != ndim - 2 or not all(isinstance(p, torch.fx.Node) and meta_val(p).dim() == ndim for p in (a, b)):
        return None
    if not seq_dims(a, sym) and seq_dims(b, sym) == (dim,) and isinstance(meta_val(a).shape[dim], int):
        return a, b, True
    if not seq_dims(b, sym) and seq_dims(a, sym) == (dim,) and isinstance(meta_val(b).shape[dim], int):
        return b, a, False
    return None


def _mask_parts(mask, memory: int, first: bool) -> tuple | None:
    """The mask over the memory keys and over the sequence's: a concatenation's own parts, or the padded mask
    (the memory shown to every query); None for a mask built otherwise (the concatenation stays refused)."""
    if mask is None or meta_val(mask).shape[-1] == 1:
        return mask, mask
    if mask.target is aten.cat.default and len(mask.args[0]) == 2:
        dim = (mask.args[1] if len(mask.args) > 1 else mask.kwargs.get("dim", 0)) % meta_val(mask).dim()
        a, b = mask.args[0]
        if dim == meta_val(mask).dim() - 1 and meta_val(a if first else b).shape[-1] == memory:
            return (a, b) if first else (b, a)
    if mask.target in (aten.constant_pad_nd.default, aten.pad.default):  # F.pad(mask, (0, memory)): all shown
        args = bind_args(mask)
        value = args.get("value") or 0
        shows = value is True or value == 1 if meta_val(mask).dtype == torch.bool else value == 0
        if args["pad"] == ([memory, 0] if first else [0, memory]) and args.get("mode", "constant") == "constant" \
                and shows:
            return None, args["self"]
    return None


def memory_keys_as_scores(gm: torch.fx.GraphModule, sym) -> int:
    """Write out each SDPA whose keys and values put memory held whole beside the sequence (see the module doc);
    returns how many."""

    def write(node, args):
        keys, values = _memory_split(args["key"], sym), _memory_split(args["value"], sym)
        if keys is None or values is None or keys[2] != values[2] \
                or meta_val(keys[0]).shape[-2] != meta_val(values[0]).shape[-2]:
            return None
        masks = _mask_parts(args.get("attn_mask"), meta_val(keys[0]).shape[-2], keys[2])
        if masks is None:
            return None
        graph = node.graph
        q, mem_k, mem_v, scale = _operands(graph, node, {**args, "key": keys[0], "value": values[0]})
        _, seq_k, seq_v, _ = _operands(graph, node, {**args, "key": keys[1], "value": values[1]})
        parts = [(_scores(graph, node, q, mem_k, scale, masks[0]), mem_v),
                 (_scores(graph, node, q, seq_k, scale, masks[1]), seq_v)]
        top = [emit(graph, node, aten.amax.default, (s, [-1], True)) for s, _ in parts]
        top = emit(graph, node, aten.detach.default, (emit(graph, node, aten.maximum.default, tuple(top)),))
        top = emit(graph, node, aten.where.ScalarSelf, (emit(graph, node, aten.eq.Scalar, (top, -math.inf)), 0.0, top))
        weights = [emit(graph, node, aten.exp.default, (emit(graph, node, aten.sub.Tensor, (s, top)),))
                   for s, _ in parts]
        total = emit(graph, node, aten.add.Tensor, tuple(
            emit(graph, node, aten.sum.dim_IntList, (w, [-1], True)) for w in weights))
        out = emit(graph, node, aten.add.Tensor, tuple(
            emit(graph, node, aten.matmul.default, (w, v)) for w, (_, v) in zip(weights, parts)))
        total = emit(graph, node, aten.where.ScalarSelf, (emit(graph, node, aten.eq.Scalar, (total, 0)), 1.0, total))
        return emit(graph, node, aten.div.Tensor, (out, total))

    return _each_sdpa(gm, write)
