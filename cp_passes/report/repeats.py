"""A stack of identical region calls partitioned as three, its saved tensors counted as all of them.

The single-device memory estimate partitions the whole model with AOTAutograd, whose cost grows with every
call of every region (about 45 ms a layer on this machine: the call is traced, functionalized and differentiated
at the outer level each time, though its subgraph is traced once). What one call of a region saves is fixed by
the region's own partition, and a call whose neighbours are calls of the same region, reading each other's
results and nothing else, sees what every such call sees. So a run of calls ``c1 .. cn`` (n > 3) that form such a
chain is cut to ``c1, c2, cn`` (``cn`` reads ``c2``'s results where it read ``c(n-1)``'s), partitioned, and the
saved tensors of ``c2``, the middle call, are counted once more for each call taken out, under its block's path.

The chain is checked, not assumed (:func:`_carry`): the calls run one subgraph with operands of one signature;
every operand of a call is the one its predecessor got (the positions' cos and sin), a parameter only this call
reads, or a result of its predecessor at the position every call of the run uses; a call's results are read by
its successor alone. Calls that do not chain stay as they are.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from ..graph.calls import call_signature, calls_by_subgraph, operands
from .memory import Saved, module_of, region_call_of


@dataclasses.dataclass(frozen=True)
class Elided:
    """Calls taken out of a run: ``kept`` is the position, among the cut graph's ``calls`` region calls in order,
    of the middle call that stands for them; ``blocks`` are the blocks they ran and ``kept_block`` the middle
    call's."""

    kept: int
    calls: int
    kept_block: str
    blocks: tuple[str, ...]


def _own(value, call: torch.fx.Node) -> bool:
    """``value`` is a graph input (a parameter) that only ``call`` reads."""
    return isinstance(value, torch.fx.Node) and value.op == "placeholder" and set(value.users) == {call}


def _carry(prev: torch.fx.Node, call: torch.fx.Node) -> tuple | None:
    """How ``call`` reads ``prev``, per operand: ``"same"`` (the operand ``prev`` got), ``"own"`` (a parameter of
    its own, as ``prev``'s was) or ``k`` (``prev``'s ``k``-th result); None if ``call`` is not ``prev``'s repeat."""
    if prev.args[0].target != call.args[0].target or call_signature(prev) != call_signature(call):
        return None
    pattern = []
    for before, now in zip(operands(prev), operands(call)):
        if now is before or (not isinstance(now, torch.fx.Node) and not isinstance(before, torch.fx.Node)
                             and now == before):
            pattern.append("same")
        elif isinstance(now, torch.fx.Node) and now.target is operator.getitem and now.args[0] is prev:
            pattern.append(now.args[1])
        elif _own(before, prev) and _own(now, call):
            pattern.append("own")
        else:
            return None
    return tuple(pattern)


def _read_only_by(call: torch.fx.Node, successor: torch.fx.Node) -> bool:
    return all(user.target is operator.getitem and set(user.users) == {successor} for user in call.users)


def _runs(calls: list[torch.fx.Node]) -> list[list[torch.fx.Node]]:
    """The maximal chains among one subgraph's calls (in graph order) that are worth cutting (four or more)."""
    runs, run, pattern = [], calls[:1], None
    for prev, call in zip(calls, calls[1:]):
        carry = _carry(prev, call)
        if carry is not None and (pattern is None or carry == pattern) and _read_only_by(prev, call):
            run.append(call)
            pattern = carry
            continue
        runs.append(run)
        run, pattern = [call], None
    runs.append(run)
    return [run for run in runs if len(run) > 3]


def elide_repeats(gm: torch.fx.GraphModule) -> list[Elided]:
    """Cut each chain of four or more calls of one region in ``gm`` to its first, second and last call."""
    cut = []
    for calls in calls_by_subgraph(gm).values():
        for run in _runs(calls):
            second, last = run[1], run[-1]
            results = {user.args[1]: user for user in second.users}
            last.args = last.args[:2] + tuple(results[v.args[1]] if isinstance(v, torch.fx.Node) and v.target is
                                              operator.getitem and v.args[0] is run[-2] else v
                                              for v in operands(last))
            for call in reversed(run[2:-1]):
                getter = call.args[0]
                for user in list(call.users):
                    gm.graph.erase_node(user)
                gm.graph.erase_node(call)
                if not getter.users:
                    gm.graph.erase_node(getter)
            cut.append((second, tuple(module_of(call) or "" for call in run[2:-1])))
    if not cut:
        return []
    gm.graph.lint()
    gm.recompile()
    order = list(gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph))
    return [Elided(order.index(second), len(order), module_of(second) or "", blocks) for second, blocks in cut]


def count_elided(saved: list[Saved], forward: torch.fx.GraphModule, elided: list[Elided]) -> list[Saved]:
    """``saved`` (the partition of the cut graph) with each kept middle call's tensors repeated for every call
    taken out, under that call's block."""
    if not elided:
        return saved
    calls = list(forward.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph))
    if len(calls) != elided[0].calls:
        raise RuntimeError(f"the partitioned forward makes {len(calls)} region calls where the cut graph made "
                           f"{elided[0].calls}: its saved tensors cannot be matched to the calls taken out")
    made_by = {node.name: region_call_of(node) for node in forward.graph.nodes}
    out = list(saved)
    for cut in elided:
        middle = calls[cut.kept]
        own = [s for s in saved if made_by.get(s.name) is middle]
        for block in cut.blocks:
            out.extend(dataclasses.replace(s, name=f"{s.name} (as in {block})",
                                           module=block + s.module[len(cut.kept_block):]
                                           if cut.kept_block and s.module.startswith(cut.kept_block) else s.module)
                       for s in own)
    return out
