"""Ordinary code over the sequence, spelled in the forms the rules read before anything is planned.

- ``torch.arange(a, a + k * S, k)`` (cumulative means ``cumsum / arange(1, S + 1)``) is ``arange(S) * k + a``:
  positions, which the positions transport offsets per rank.
- A mean over a sequence dim (``logsumexp(logits, -1).pow(2).mean()``, a router's ``probs.mean((0, 1))``) is
  its sum divided by the count of what it reduces: a per-rank partial sum over a row count from the local
  length, which the partial-sum rules make global (and refuse where padding would be counted).
- ``x[mask].sum()`` and ``x[mask].mean()`` with a boolean mask over the sequence (``per_token[labels != -100]
  .mean()``) are ``where(mask, x, 0).sum()`` and that over ``mask.sum()`` (times the elements of a row): the
  selection's length is the rank's own, its sum and count partial sums.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx

from .analysis import bind_args, has_symbol, meta_val
from .emit import emit

aten = torch.ops.aten

_ARANGES = (aten.arange.start, aten.arange.start_step)
_MEANS = (aten.mean.default, aten.mean.dim)
_SUMS = (aten.sum.default, aten.mean.default)


def _replace(graph: torch.fx.Graph, old: torch.fx.Node, new: torch.fx.Node) -> None:
    old.replace_all_uses_with(new)
    graph.erase_node(old)


def aranges_from_zero(gm: torch.fx.GraphModule, sym) -> int:
    """``arange(a, b, k)`` (integers, ``k > 0``, as many values as the sequence has positions or windows) as
    ``arange(n) * k + a``."""
    rewritten = 0
    for node in [n for target in _ARANGES for n in gm.graph.find_nodes(op="call_function", target=target)]:
        args = bind_args(node)
        start, end, step = args["start"], args["end"], args.get("step", 1)
        if not isinstance(start, int) or not isinstance(step, int) or step <= 0 or (start == 0 and step == 1) \
                or not isinstance(end, torch.fx.Node) or not has_symbol(meta_val(node).shape[0], sym):
            continue
        graph = node.graph
        kwargs = {k: v for k, v in node.kwargs.items() if k in ("dtype", "layout", "device", "pin_memory")}
        with graph.inserting_before(node):
            length = emit(graph, node, operator.sub, (end, start))
            if step != 1:  # ceil((end - start) / step)
                length = emit(graph, node, operator.floordiv, (emit(graph, node, operator.add, (length, step - 1)),
                                                               step))
            positions = emit(graph, node, aten.arange.default, (length,), kwargs)
            if step != 1:
                positions = emit(graph, node, aten.mul.Tensor, (positions, step))
            shifted = emit(graph, node, aten.add.Tensor, (positions, start)) if start else positions
        _replace(graph, node, shifted)
        rewritten += 1
    return rewritten


def _count(graph: torch.fx.Graph, like: torch.fx.Node, x: torch.fx.Node, dims) -> torch.fx.Node:
    """The number of elements of ``x`` over ``dims`` (all of them when None), as a SymInt node."""
    if dims is None:
        return emit(graph, like, aten.sym_numel.default, (x,))
    count = None
    for d in dims:
        size = emit(graph, like, aten.sym_size.int, (x, d))
        count = size if count is None else emit(graph, like, operator.mul, (count, size))
    return count


def means_as_sums(gm: torch.fx.GraphModule, sym) -> int:
    """A mean whose reduced dims include a sequence dim as its sum over their element count."""
    rewritten = 0
    for node in [n for target in _MEANS for n in gm.graph.find_nodes(op="call_function", target=target)]:
        args = bind_args(node)
        x = args["self"]
        ndim = meta_val(x).dim()
        dims = args.get("dim")
        dims = None if not dims else [d % ndim for d in dims]
        reduced = range(ndim) if dims is None else dims
        if not any(has_symbol(meta_val(x).shape[d], sym) for d in reduced):
            continue
        graph = node.graph
        with graph.inserting_before(node):
            if dims is None:
                total = emit(graph, node, aten.sum.default, (x,), {"dtype": args.get("dtype")})
            else:
                total = emit(graph, node, aten.sum.dim_IntList, (x, dims, args.get("keepdim", False)),
                             {"dtype": args.get("dtype")})
            mean = emit(graph, node, aten.div.Tensor, (total, _count(graph, node, x, dims)))
        _replace(graph, node, mean)
        rewritten += 1
    return rewritten


def _size_checks(node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The nodes that only check ``node``'s data-dependent length (``u0 >= 0``: its sizes, comparisons of them
    and the runtime assertions they feed), users first; None if another reads them."""
    found, stack = [], [u for u in node.users if u.target is aten.sym_size.int]
    while stack:
        user = stack.pop()
        if user in found:
            continue
        if user.target is not aten._assert_scalar.default and not (
                user.target is aten.sym_size.int or getattr(user.target, "__module__", None) == "_operator"):
            return None
        found.append(user)
        stack.extend(user.users)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(found, key=order.get, reverse=True)


def masked_selections_reduced(gm: torch.fx.GraphModule, sym) -> int:
    """``x[mask]`` read only by whole sums and means (and checks of its length), with ``mask`` boolean over
    ``x``'s leading dims and the sequence among them, as masked sums (and the mask's count)."""
    rewritten = 0
    for node in list(gm.graph.find_nodes(op="call_function", target=aten.index.Tensor)):
        x, indices = node.args[0], node.args[1]
        if len(indices) != 1 or not isinstance(indices[0], torch.fx.Node):
            continue
        mask = indices[0]
        mask_val, x_val = meta_val(mask), meta_val(x)
        checks = _size_checks(node)
        reductions = [u for u in node.users if u.target is not aten.sym_size.int]
        if mask_val.dtype != torch.bool or not any(has_symbol(s, sym) for s in mask_val.shape) \
                or tuple(mask_val.shape) != tuple(x_val.shape[:mask_val.dim()]) or checks is None \
                or not reductions or not all(u.target in _SUMS and len(u.args) == 1 and not u.kwargs
                                             for u in reductions):
            continue
        rest = x_val.shape[mask_val.dim():]
        if not all(isinstance(s, int) for s in rest):
            continue
        graph = node.graph
        with graph.inserting_before(node):
            spread = mask if not rest else emit(graph, node, aten.view.default,
                                                (mask, [*mask_val.shape, *[1] * len(rest)]))
            kept = emit(graph, node, aten.where.ScalarOther, (spread, x, 0))
        for check in checks:
            graph.erase_node(check)
        for user in reductions:
            with graph.inserting_before(user):
                total = emit(graph, user, aten.sum.default, (kept,))
                if user.target is aten.mean.default:
                    count = emit(graph, user, aten.sum.default, (mask,))
                    if math.prod(rest) != 1:
                        count = emit(graph, user, aten.mul.Tensor, (count, math.prod(rest)))
                    total = emit(graph, user, aten.div.Tensor, (total, count))
            _replace(graph, user, total)
        graph.erase_node(node)
        rewritten += 1
    return rewritten


def _einsum_plan(equation: str, ranks: tuple[int, int]):
    """``(a's order, b's order, left, right, out order)`` of letters for a two-operand einsum that one matmul
    computes (see :func:`einsums_as_matmuls`), or None."""
    if "..." in equation or "->" not in equation:
        return None
    inputs, out = equation.replace(" ", "").split("->")
    operands = inputs.split(",")
    if len(operands) != 2 or any(len(op) != rank for op, rank in zip(operands, ranks)):
        return None
    a, b = operands
    if any(len(set(s)) != len(s) for s in (a, b, out)) or not set(out) <= set(a) | set(b) \
            or (set(a) ^ set(b)) - set(out):
        return None
    batch = [c for c in out if c in a and c in b]
    left, right = [c for c in out if c not in b], [c for c in out if c not in a]
    contracted = [c for c in a if c in b and c not in out]
    if len(contracted) != 1 or len(right) > 1 or (len(left) > 1 and batch):
        return None
    return batch + left + contracted, batch + contracted + right, left, right, batch + left + right, out


def einsums_as_matmuls(gm: torch.fx.GraphModule) -> int:
    """A two-operand einsum that contracts one dim (``"bhqd,bhkd->bhqk"``, ``"bqhd,bkhd->bqhk"``, a projection
    ``"bsd,hd->bsh"``) as permutes and one matmul: the form attention written with ``q @ k.transpose(-1, -2)``
    has, which the rules read."""
    rewritten = 0
    for node in list(gm.graph.find_nodes(op="call_function", target=aten.einsum.default)):
        equation, operands = node.args[0], node.args[1]
        if len(operands) != 2 or not all(isinstance(o, torch.fx.Node) for o in operands):
            continue
        plan = _einsum_plan(equation, tuple(meta_val(o).dim() for o in operands))
        if plan is None:
            continue
        a_order, b_order, left, right, made, out = plan
        graph = node.graph
        (a_letters, b_letters) = equation.replace(" ", "").split("->")[0].split(",")
        with graph.inserting_before(node):
            a = emit(graph, node, aten.permute.default, (operands[0], [a_letters.index(c) for c in a_order]))
            b = emit(graph, node, aten.permute.default, (operands[1], [b_letters.index(c) for c in b_order]))
            if not left:
                a = emit(graph, node, aten.unsqueeze.default, (a, -2))
            if not right:
                b = emit(graph, node, aten.unsqueeze.default, (b, -1))
            product = emit(graph, node, aten.matmul.default, (a, b))
            if not right:
                product = emit(graph, node, aten.squeeze.dim, (product, -1))
            if not left:
                product = emit(graph, node, aten.squeeze.dim, (product, -1 if not right else -2))
            result = emit(graph, node, aten.permute.default, (product, [made.index(c) for c in out]))
        _replace(graph, node, result)
        rewritten += 1
    return rewritten
