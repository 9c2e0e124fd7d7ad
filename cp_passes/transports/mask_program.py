"""A model-built mask as structure: per-position vectors and the elementwise program that combines them.

The model's mask at this rank's rows and the keys brought (:func:`~cp_passes.transports.attention.local_mask`)
is, after :class:`~cp_passes.graph.selection.Selector` moved the picks to the inputs, a broadcast of per-query
terms (``q_pos[:, None]``, ``doc[q][:, :, None]``) against per-key terms, combined elementwise. Rather than
computing it ``[queries, keys]`` in the graph, :func:`split_mask` cuts the mask's graph where both sides meet:
the terms (the *leaves*, ``O(queries + keys)``) are computed in the graph, and the elementwise rest is written
down as a program (a string: each op and its arguments) that the attention op evaluates tile by tile
(:func:`evaluate`), as FlexAttention's kernels evaluate a ``mask_mod``. No ``[queries, keys]`` tensor exists in
the graph, and at run time at most a tile of it.

A mask the split cannot write down (a reduction, a view of the ``[queries, keys]`` block) stays a tensor.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx

from ..graph.selection import FACTORIES
from ..key_plan import outside_band_counts

aten = torch.ops.aten

QUERY, KEY = "query_positions", "key_positions"
"""The picked mask module's placeholders for the two sides (:func:`~.attention.mask_module`)."""

_PASS = {aten.slice.Tensor, aten.expand.default, aten.alias.default, aten.clone.default, aten.detach.default}
"""Ops a program passes its input through: whole slices and broadcasts (the tile's own shapes broadcast)."""

_ELEMENTWISE = {aten.__and__.Tensor, aten.__or__.Tensor, aten.__xor__.Tensor, aten.logical_not.default,
                aten.bitwise_not.default, aten.unsqueeze.default, aten._to_copy.default, aten.to.dtype,
                aten.to.dtype_layout, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar,
                aten.floor_divide.default}
"""Elementwise ops without ATen's pointwise tag (a cast keeps its dtype; its layout and device are the tile's)."""


@dataclass(frozen=True)
class MaskProgram:
    """A mask in the graph as its per-position terms (``leaves``, graph nodes) and the program combining them."""

    leaves: tuple
    program: str
    key_positions: torch.fx.Node
    """The global positions of the keys the mask is evaluated at."""


def _writable(node: torch.fx.Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return False
    if target in _PASS:
        return target is not aten.slice.Tensor or _whole(node)
    return target in FACTORIES or target in _ELEMENTWISE or torch.Tag.pointwise in target.tags


def _whole(node: torch.fx.Node) -> bool:
    args = list(node.args) + [None] * (5 - len(node.args))
    return args[2] in (None, 0) and args[4] in (None, 1) and isinstance(args[3], int) and args[3] >= 2 ** 62


_PLACEMENT = {"device", "layout", "pin_memory", "memory_format", "non_blocking"}
"""Keyword arguments that place a value, not compute it: a tile is where its leaves are."""


def _sizes(sizes) -> str | None:
    """A factory's sizes as a token: ``[1,ROWS,KEYS]``, where ``ROWS`` and ``KEYS`` are the lengths of the queries'
    and the keys' picks (a tile's); None for any other size that is not an int."""
    items = []
    for size in sizes:
        if isinstance(size, torch.fx.Node) and size.target is aten.sym_size.int and size.args[1] == 0 and \
                size.args[0].op == "placeholder" and size.args[0].target in (QUERY, KEY):
            items.append("ROWS" if size.args[0].target == QUERY else "KEYS")
        elif isinstance(size, int):
            items.append(str(size))
        else:
            return None
    return "[" + ",".join(items) + "]"


def _literal(value) -> str | None:
    """``value`` as a program token, or None where a program cannot hold it."""
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, str) and value.isidentifier():
        return repr(value)
    if isinstance(value, torch.dtype):
        return str(value)
    return None


def split_mask(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, str] | None:
    """``(leaves module, program)``: a module of the mask's inputs returning its per-position terms, and the
    program that combines them into the mask (:func:`evaluate`); None where the mask cannot be written so."""
    graph = gm.graph
    sides: dict[torch.fx.Node, frozenset] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            sides[node] = frozenset({node.target}) if node.target in (QUERY, KEY) else frozenset()
        elif node.op == "call_function":
            sides[node] = frozenset().union(*(sides.get(n, frozenset()) for n in node.all_input_nodes))
    output = next(n for n in graph.nodes if n.op == "output")
    (mask,) = output.args
    if not isinstance(mask, torch.fx.Node) or sides.get(mask) != {QUERY, KEY}:
        return None
    both = [n for n in graph.nodes if sides.get(n) == {QUERY, KEY}]
    if not all(_writable(n) for n in both) or both[-1] is not mask:
        return None
    leaves: list[torch.fx.Node] = []
    registers = {n: i for i, n in enumerate(both)}
    lines = []
    for node in both:
        tokens = []
        for arg in node.args:
            if isinstance(arg, torch.fx.Node):
                if arg in registers:
                    tokens.append(f"R{registers[arg]}")
                    continue
                if arg not in leaves:
                    leaves.append(arg)
                side = "Q" if sides[arg] == {QUERY} else "K" if sides[arg] == {KEY} else "C"
                tokens.append(f"{side}{leaves.index(arg)}")
            elif node.target is aten.expand.default or node.target is aten.slice.Tensor:
                tokens.append("None")  # sizes and bounds of a pass-through: not read
            elif node.target in FACTORIES and arg is node.args[FACTORIES[node.target]]:
                sizes = _sizes(arg)
                if sizes is None:
                    return None
                tokens.append(sizes)
            else:
                literal = _literal(arg)
                if literal is None:
                    return None
                tokens.append(literal)
        for key, value in node.kwargs.items():
            if key in _PLACEMENT:
                continue
            literal = _literal(value)
            if literal is None:
                return None
            tokens.append(f"{key}={literal}")
        lines.append(" ".join([str(node.target)] + tokens))
    program = ";".join(lines)
    terms = torch.fx.Graph()
    env = {}
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr") or (node.op == "call_function" and node not in registers):
            env[node] = terms.node_copy(node, env.__getitem__)
    terms.output(tuple(env[leaf] for leaf in leaves))
    terms.eliminate_dead_code()
    return torch.fx.GraphModule(gm, terms), program


def _op(name: str):
    namespace, packet, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)


def _value(token: str, registers: list, leaves, rows: slice, keys: slice):
    if token[0] in "QKCR" and token[1:].isdigit():
        index = int(token[1:])
        if token[0] == "R":
            return registers[index]
        leaf = leaves[index]
        if token[0] == "Q" and leaf.dim() >= 2 and leaf.shape[-2] > 1:
            return leaf[..., rows, :]
        if token[0] == "K" and leaf.shape[-1] > 1:
            return leaf[..., keys]
        return leaf
    if token[0] == "[":
        counts = {"ROWS": rows.stop - rows.start, "KEYS": keys.stop - keys.start}
        return [counts[item] if item in counts else int(item) for item in token[1:-1].split(",") if item]
    if token.startswith("torch."):
        return getattr(torch, token[len("torch."):])
    if token[0] == "'":
        return token[1:-1]
    return {"None": None, "True": True, "False": False}.get(token) if token in ("None", "True", "False") \
        else (float(token) if any(c in token for c in ".einf") else int(token))


@functools.lru_cache(maxsize=64)
def parsed_program(program: str) -> tuple:
    """``program``'s lines as ``(op, argument tokens, keyword tokens)``."""
    lines = []
    for line in program.split(";"):
        name, *tokens = line.split(" ")
        lines.append((_op(name), [t for t in tokens if "=" not in t],
                      [tuple(t.split("=", 1)) for t in tokens if "=" in t]))
    return tuple(lines)


def evaluate(program: str, leaves: list[torch.Tensor], rows: slice, keys: slice) -> torch.Tensor:
    """The mask at query rows ``rows`` and keys ``keys``: ``program`` run on those rows of the per-query leaves
    and those keys of the per-key leaves."""
    registers: list = []
    for op, tokens, keywords in parsed_program(program):
        args = [_value(t, registers, leaves, rows, keys) for t in tokens]
        if op in _PASS:
            registers.append(args[0])
            continue
        placed = {"device": leaves[0].device} if op in FACTORIES and leaves else {}
        registers.append(op(*args, **{k: _value(v, registers, leaves, rows, keys) for k, v in keywords}, **placed))
    return registers[-1]


def tiles(rows: int, keys: int, budget: int = 1 << 24) -> int:
    """Rows per tile so that one tile of a mask holds at most ``budget`` entries (at least one row)."""
    return max(1, min(rows, budget // max(1, keys)))


@torch.library.custom_op("cp_passes::program_first_keys", mutates_args=())
def program_first_keys_op(leaves: list[torch.Tensor], program: str, query: torch.Tensor, key_positions: torch.Tensor,
                          chunks: int) -> torch.Tensor:
    """:func:`~.masks.first_keys` of the mask ``program`` describes, tile by tile: for each of the rank's
    ``chunks`` ranges of ``query``'s rows, the first key any of its queries sees (the keys' count where none)."""
    local, total = query.shape[-2], key_positions.shape[0]
    size = local // chunks
    step = tiles(size, total)
    firsts = []
    for c in range(chunks):
        seen = torch.zeros(total, dtype=torch.bool, device=query.device)
        for first in range(c * size, (c + 1) * size, step):
            block = evaluate(program, leaves, slice(first, min((c + 1) * size, first + step)), slice(0, total))
            seen |= block.reshape(-1, block.shape[-1]).any(0).expand(total)
        firsts.append(seen.to(torch.int8).argmax() if bool(seen.any()) else torch.tensor(total, device=query.device))
    return torch.stack(firsts).to(torch.int64)


@program_first_keys_op.register_fake
def _(leaves, program, query, key_positions, chunks):
    return query.new_empty(chunks, dtype=torch.int64)


def hidden(mask: torch.Tensor, hides: str) -> torch.Tensor:
    """The entries of ``mask`` that hide a key (see :class:`~cp_passes.match.key_cuts.Masking`)."""
    if hides == "additive":
        return mask <= torch.finfo(mask.dtype).min / 2
    return mask if hides == "true" else ~mask


def hidden_together(masks: list[torch.Tensor], steps: tuple, dims: tuple) -> torch.Tensor:
    """The keys that ``masks``, applied as the model applies them, leave at or below half of ``finfo.min``:
    ``steps`` holds each one's ``(hides, fill, dtype)`` (:class:`~cp_passes.match.key_cuts.Masking`), the
    one applied last first. The masks are replayed on a score of zero, first applied first, so a later
    additive mask that lifts what an earlier one hid (``finfo.max`` added to ``finfo.min``) shows that key
    again, where a union of what each hides would not. ``dims`` are each mask's ``(query, key)`` dims, moved
    last; the other dims line up from the right, as the model's broadcasting does."""
    value = None
    for mask, (hides, fill, dtype), (q, k) in reversed(list(zip(masks, steps, dims))):
        mask = mask.movedim((q, k), (-2, -1))
        if value is None:
            value = torch.zeros(1, dtype=dtype, device=mask.device)
        if hides == "additive":
            value = value + mask
        else:
            value = torch.where(hidden(mask, hides), torch.tensor(fill, dtype=value.dtype, device=mask.device), value)
        value = value.to(dtype)
    return value <= torch.finfo(value.dtype).min / 2


def hidden_counts(masks: list[torch.Tensor], steps: tuple, dims: tuple, query_positions: torch.Tensor,
                  key_positions: torch.Tensor, before: int | None, after: int = 0) -> torch.Tensor:
    """:func:`~cp_passes.key_plan.outside_band_counts` of what the masks together (:func:`hidden_together`) show,
    evaluated at the queries at ``query_positions`` and the keys at ``key_positions``."""
    return outside_band_counts(~hidden_together(masks, steps, dims), query_positions, key_positions, before, after)


SHOWN = "shown"
"""``steps`` of one boolean mask that shows a key where it is True (SDPA's)."""


def steps_text(steps: tuple) -> str:
    """``steps`` (:func:`hidden_together`) as text, for :func:`outside_keys_op`."""
    return ";".join(f"{hides},{fill!r},{str(dtype).removeprefix('torch.')}" for hides, fill, dtype in steps)


def _steps(text: str) -> tuple:
    steps = []
    for step in text.split(";"):
        hides, fill, dtype = step.split(",")
        steps.append((hides, None if fill == "None" else float(fill),
                      None if dtype == "None" else getattr(torch, dtype)))
    return tuple(steps)


@torch.library.custom_op("cp_passes::outside_keys", mutates_args=())
def outside_keys_op(leaves: list[torch.Tensor], programs: str, counts: list[int], steps: str,
                    query_positions: torch.Tensor, key_positions: torch.Tensor, before: Optional[int],
                    after: int) -> torch.Tensor:
    """The one tiled count of what masks show outside a band: :func:`~cp_passes.key_plan.outside_band_counts` of
    the masks ``programs`` describe (one per line, the one applied last first; ``counts[i]`` of ``leaves`` each,
    :func:`split_mask`'s terms), combined as ``steps`` says (:func:`hidden_together`; :data:`SHOWN`: one boolean
    mask, True where a query sees a key), a tile of queries at a time: nothing ``[queries, keys]`` is held
    whole."""
    texts = programs.split("\n")
    groups, start = [], 0
    for count in counts:
        groups.append(leaves[start:start + count])
        start += count
    rows, total = query_positions.shape[0], key_positions.shape[0]
    step, found = tiles(rows, total * len(texts)), torch.zeros(2, dtype=torch.int64, device=query_positions.device)
    for first in range(0, rows, step):
        part = slice(first, min(rows, first + step))
        masks = [evaluate(text, group, part, slice(0, total)) for text, group in zip(texts, groups)]
        shown = masks[0] if steps == SHOWN else ~hidden_together(masks, _steps(steps), ((-2, -1),) * len(masks))
        found += outside_band_counts(shown, query_positions[part], key_positions, before, after)
    return found


@outside_keys_op.register_fake
def _(leaves, programs, counts, steps, query_positions, key_positions, before, after):
    return query_positions.new_empty(2, dtype=torch.int64)
