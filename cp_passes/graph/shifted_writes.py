"""Writes of a sequence slice at an offset, spelled as shifts before anything is planned.

DeepSeek V4's CSA compressor pairs each window with the previous one by writing ``x[:, :-k]`` into rows
``k:`` of a fresh tensor (``new[:, k:, :m] = x[:, :-k, :, :d]``, which :mod:`cp_passes.graph.fills` has
made ``slice_scatter(base, y, dim, k)``). On a shard both slices would be taken from this rank's rows.
The same value is ``where(row >= k, y', base)`` with ``y'`` computed as ``y`` was but from ``x`` shifted
by ``k`` rows (``pad(x, k before)[:, :n]``, which the shift transport serves: only the ``k`` rows a shard
lacks move) and from the whole base instead of its rows ``k:``. That holds when every op between the
slices and ``y`` treats the rows of ``dim`` alike (slices and scatters of other dims, broadcasts to the
written view, dtype casts). Anything else is left for the planner, which refuses it naming the slice.

A pad with a negative width crops: RWKV's time shift ``nn.ZeroPad2d((0, 0, 1, -1))`` (``F.pad(x, (.., 1, -1))``)
is a pad of one row before and the last row dropped. :func:`cropping_pads_as_slices` writes it so, a pad with
the widths that are not negative and a slice of what they crop, which is the form the shift transport serves.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from .analysis import bind_args, expr_of, meta_val, window
from .emit import emit

aten = torch.ops.aten

_ROWWISE = {aten.slice.Tensor, aten.slice_scatter.default, aten.expand_as.default, aten.type_as.default,
            aten.clone.default, aten.alias.default, aten.to.dtype, aten._to_copy.default}
"""Ops that treat every row of a dim alike, unless they slice or scatter that dim."""

_LARGE = 2 ** 62
"""An end at or past this is "to the end" (``x[:, k:]`` traces as end = sys.maxsize)."""


def _size(node, dim):
    return expr_of(meta_val(node).shape[dim])


def _source(node: torch.fx.Node, dim: int, k: int) -> bool:
    """Whether ``node`` is ``x[..., :-k]`` (from row 0, all but the last ``k``) along ``dim``."""
    if node.target is not aten.slice.Tensor:
        return False
    args = bind_args(node)
    x = args["self"]
    if args["dim"] % meta_val(x).dim() != dim or (args["start"] or 0) != 0 or args["step"] != 1:
        return False
    return _size(node, dim) - _size(x, dim) == -k


def _region(node: torch.fx.Node, base: torch.fx.Node, dim: int, k: int) -> bool:
    """Whether ``node`` is ``base[..., k:]`` along ``dim``."""
    if node.target is not aten.slice.Tensor or node.args[0] is not base:
        return False
    args = bind_args(node)
    return args["dim"] % meta_val(base).dim() == dim and args["start"] == k and args["step"] == 1 and (
        _size(node, dim) - _size(base, dim) == -k)


def _chain(write: torch.fx.Node, dim: int, k: int, sym):
    """``(nodes from the slices to y in graph order, sources, regions)`` for ``write`` =
    ``slice_scatter(base, y, dim, k)``, or None unless ``y`` comes from ``x[..., :-k]`` slices and the
    base's rows ``k:`` through row-wise ops that only ``write`` reads."""
    base, y = write.args[0], write.args[1]
    chain, sources, regions, stack = set(), set(), set(), [y]
    while stack:
        node = stack.pop()
        if node in chain or node in sources or node in regions:
            continue
        if _region(node, base, dim, k):
            regions.add(node)
            continue
        if _source(node, dim, k) and sym in _size(node.args[0], dim).free_symbols:
            sources.add(node)
            continue
        if node.target not in _ROWWISE:
            return None
        if node.target in (aten.slice.Tensor, aten.slice_scatter.default) and (
                bind_args(node)["dim"] % meta_val(node).dim() == dim):
            return None
        chain.add(node)
        for arg in node.all_input_nodes:
            val = meta_val(arg)
            if isinstance(val, torch.Tensor) and any(sym in _size(arg, d).free_symbols for d in range(val.dim())):
                stack.append(arg)
    if not sources:
        return None
    inside = chain | sources | regions
    if any(u not in inside and u is not write for n in inside for u in n.users):
        return None
    order = {n: i for i, n in enumerate(write.graph.nodes)}
    return sorted(chain, key=order.get), sources, regions


def _rewrite(write: torch.fx.Node, dim: int, k: int, found) -> None:
    chain, sources, regions = found
    absorbed = set(chain)
    graph, base = write.graph, write.args[0]
    base_dims = meta_val(base).dim()
    new = dict.fromkeys(regions, base)
    with graph.inserting_before(write):
        for source in sources:
            # Slices of other dims right after the source are taken first: only what is written moves.
            x, last = source.args[0], source
            while len(last.users) == 1 and next(iter(last.users)) in chain:
                (user,) = last.users
                if user.target is not aten.slice.Tensor or bind_args(user)["dim"] % meta_val(user).dim() == dim:
                    break
                x = emit(graph, user, aten.slice.Tensor, (x, *user.args[1:]), dict(user.kwargs))
                chain.remove(user)
                last = user
            widths = [0, 0] * (meta_val(x).dim() - dim - 1) + [k, 0]
            padded = emit(graph, write, aten.constant_pad_nd.default, (x, widths, 0.0))
            rows = emit(graph, write, aten.sym_size.int, (x, dim))
            new[last] = emit(graph, write, aten.slice.Tensor, (padded, dim, 0, rows))
        for node in chain:
            args, kwargs = torch.fx.map_arg((node.args, node.kwargs), lambda n: new.get(n, n))
            new[node] = emit(graph, node, node.target, args, kwargs)
        y = new[write.args[1]]
        rows = emit(graph, write, aten.sym_size.int, (base, dim))
        index = emit(graph, write, aten.arange.default, (rows,), {"device": meta_val(base).device})
        later = emit(graph, write, aten.ge.Scalar, (index, k))
        later = emit(graph, write, aten.view.default, (later, [-1 if d == dim else 1 for d in range(base_dims)]))
        result = emit(graph, write, aten.where.self, (later, y, base))
    write.replace_all_uses_with(result)
    graph.erase_node(write)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted({*absorbed, *sources, *regions}, key=order.get, reverse=True):  # users before producers
        if not node.users:
            graph.erase_node(node)


def shifted_writes_as_shifts(gm: torch.fx.GraphModule, sym, multiple: int = 1) -> int:
    """Rewrite the writes described in the module doc along positions or windows of them (``multiple``: the
    spec's ``pad_multiple``); returns how many were rewritten."""
    rewritten = 0
    for write in list(gm.graph.find_nodes(op="call_function", target=aten.slice_scatter.default)):
        args = bind_args(write)
        dim, k, end = args["dim"] % meta_val(write).dim(), args["start"], args["end"]
        if not (isinstance(k, int) and k > 0 and args["step"] == 1 and isinstance(end, int) and end >= _LARGE):
            continue
        if window(meta_val(write).shape[dim], sym, multiple) is None:  # not the sequence, or merged with batch rows
            continue
        found = _chain(write, dim, k, sym)
        if found is not None:
            _rewrite(write, dim, k, found)
            rewritten += 1
    gm.recompile()
    return rewritten


_PADS = (aten.pad.default, aten.constant_pad_nd.default)


def cropping_pads_as_slices(gm: torch.fx.GraphModule) -> int:
    """Rewrite every constant pad with a negative width as a pad of the other widths and a slice of each dim it
    crops (the same value); returns how many were rewritten."""
    rewritten = 0
    for pad in [n for target in _PADS for n in gm.graph.find_nodes(op="call_function", target=target)]:
        args = bind_args(pad)
        widths, value = list(args["pad"]), args.get("value")
        if args.get("mode", "constant") != "constant" or not all(isinstance(w, int) for w in widths) \
                or min(widths, default=0) >= 0:
            continue
        graph, x = pad.graph, args["self"]
        ndim = meta_val(x).dim()
        with graph.inserting_before(pad):
            out = emit(graph, pad, aten.constant_pad_nd.default,
                        (x, [max(w, 0) for w in widths], 0.0 if value is None else value))
            for i in range(0, len(widths), 2):
                before, after = widths[i], widths[i + 1]
                if before >= 0 and after >= 0:
                    continue
                dim = ndim - 1 - i // 2
                end = emit(graph, pad, aten.sym_size.int, (x, dim))  # the source's: the pad's users stay slices
                if max(before, 0) + after:  # the padded length less what the end crops
                    end = emit(graph, pad, operator.add, (end, max(before, 0) + after))
                out = emit(graph, pad, aten.slice.Tensor, (out, dim, max(-before, 0), end))
        pad.replace_all_uses_with(out)
        graph.erase_node(pad)
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten
