"""The pipeline both the dynamo backend and the dry run call: analyse -> match -> plan -> guards -> transports ->
verify.

Its input is a pre-dispatch ATen graph whose sharded inputs carry one symbolic sequence length; its output
is the rewritten graph, and a :class:`CompileRecord` of every stage.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch
import torch.fx
from torch._dispatch.python import enable_python_dispatcher
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..errors import CPCompileError, op_name, source_line
from ..graph.analysis import meta_val, seq_dims, sequence_symbol
from ..graph.calls import calls_by_subgraph, operands
from ..graph.checkpoint import tag_transport
from ..graph.fills import fills_out_of_place
from ..graph.scores_bias import scores_bias_split
from ..graph.shifted_writes import cropping_pads_as_slices, shifted_writes_as_shifts
from ..graph.normal_forms import (aranges_from_zero, einsums_as_matmuls, masked_selections_reduced,
                                  means_as_sums)
from ..graph.trimmed_losses import trimmed_losses_as_ignored_rows
from ..graph.unread import drop_unread_values
from ..graph.propagate import propagate_changed, snapshot
from ..graph.provenance import Edit, eliminate_dead_code, format_graph, request_nodes
from ..match.written_attention import biased_sdpa_as_scores, memory_keys_as_scores
from ..layout import AUTO, BALANCED, CONTIGUOUS, resolve_layout
from ..transports import TRANSPORTS, in_order
from .guards import check_length_guards
from .interleave import interleave_readers
from .planner import Plan, RewriteRecord, plan_graph
from .regions import InlineRegion, Region, constants_as_factories, flatten_nested, inline, masks_into_region, \
    mismatch, name_placeholders, schema_once


@dataclass
class CompileRecord:
    """Everything one compiled graph went through, for ``explain`` and ``dump_dir``."""

    rank: int
    world_size: int
    local_len: int
    backend: str
    history: list[tuple[str, str]] = field(default_factory=list)
    records: list[RewriteRecord] = field(default_factory=list)
    partial_outputs: list[int] = field(default_factory=list)
    aot_graphs: dict[str, str] = field(default_factory=dict)
    aot_ops: dict[str, collections.Counter] = field(default_factory=dict)
    output_code: list[str] = field(default_factory=list)
    saved: list = field(default_factory=list)
    """What the forward saves for the backward (``report.memory.Saved``), once the backward is compiled."""
    seconds: float = 0.0
    layout: str = ""
    """Which layout the graph was rewritten for, and why (:func:`~cp_passes.layout.resolve_layout`)."""
    interleave_readers: list[str] | None = None
    """What in the graph would tell interleaved documents (``shard_batch(..., balance="documents")``) from their
    packed row, one line each (:mod:`.interleave`); empty: such batches are accepted. None: not analysed."""
    static: bool = False
    """Whether Inductor lowered it for ``local_len`` alone (``cp_compile(dynamic=None)``'s first graph)."""
    recompile_reasons: list[str] = field(default_factory=list)
    """Why this graph was compiled although the module had graphs: the guard each of them failed (dynamo's
    recompile reasons, with the source line that added the guard)."""


def find_symbol(gm: torch.fx.GraphModule, local_len: int):
    """The one symbol every sharded input's sequence dim carries."""
    symbols = sequence_symbol(list(gm.graph.find_nodes(op="placeholder")))
    if not symbols:
        raise CPCompileError(
            f"the tracer specialized the local sequence length ({local_len}): some code in the model turns "
            f"the length into a Python int (an int(), a comparison with a constant, a shape-dependent branch), so "
            f"cp_passes cannot tell positions from sizes; run with TORCH_LOGS=\"+dynamic\" to see where, and keep "
            f"the sequence length symbolic there"
        )
    if len(symbols) != 1:
        raise CPCompileError(
            f"cp_passes expected every sharded input to carry one local sequence length, found symbols "
            f"{sorted(map(str, symbols))}; check that the sharded inputs have equal length on their sequence dims"
        )
    (sym,) = symbols
    return sym


def rewrite_graph(aten_gm: torch.fx.GraphModule, fakes: list, spec, cp, record: CompileRecord,
                  record_input: bool = True) -> Plan:
    """analyse -> match -> plan -> guards on the length -> transports -> verify. Records every stage in
    ``record`` (the graph as given too, unless ``record_input`` is False: the caller recorded it); raises
    CPCompileError on refusal. Each nested compile region (:mod:`.regions`) is planned and rewritten once, as a
    graph of its own, for all its calls."""
    sym = find_symbol(aten_gm, record.local_len)
    captured = {node: was for gm in [aten_gm, *(getattr(aten_gm, name) for name in calls_by_subgraph(aten_gm))]
                for node, was in snapshot(gm).items()}
    if record_input:
        record.history.append(("aten (pre-dispatch)", aten_gm.print_readable(print_output=False)))
    prepare_graph(aten_gm, sym, spec, record.history)
    before = _output_values(aten_gm)
    plan = plan_with_regions(aten_gm, sym, spec, cp, record.history)
    plan.interleave_readers = record.interleave_readers = [
        line for _, part in plan.parts() for line in interleave_readers(part, spec)]
    check_length_guards(torch._guards.detect_fake_mode(fakes).shape_env, sym, cp.size)
    record.partial_outputs = [partial.index for partial in plan.partial_outputs]
    position, done = {node.name: i for i, node in enumerate(aten_gm.graph.nodes)}, []
    with schema_once():
        for region in plan.regions:
            region_before = _output_values(region.graph)
            applied = run_transports(region.graph, region.plan, cp, record.history, f"{region.name}: ")
            verify(region.graph, region.plan, [edit for edit, _ in applied], region.fakes(), region_before,
                   captured)
            done += applied
        applied = run_transports(aten_gm, plan, cp, record.history)
        verify(aten_gm, plan, [edit for edit, _ in applied], fakes, before, captured)
    done += applied
    record.records = table(plan, position)
    record.layout = describe_layout(spec, cp, record.records)
    regather = spec.gathered_keys == "regather"
    for edit, rewrite in done:  # after verify: the scalar test reads the values it propagated
        rewrite.backward = tag_transport(edit, regather and TRANSPORTS[edit.transport].gathers_keys)
    return plan


def prepare_graph(gm: torch.fx.GraphModule, sym, spec, history: list[tuple[str, str]]) -> None:
    """Put the graph and each region's subgraph in the form the rules read (idempotent)."""
    for name in calls_by_subgraph(gm):
        flatten_nested(getattr(gm, name))
        if not constants_as_factories(getattr(gm, name)):
            count = inline(gm, name)
            history.append((f"{name} inlined at its {count} calls: it creates a tensor from data", format_graph(gm)))
        elif masks_into_region(gm, name, lambda value: seq_dims(value, sym)):
            history.append((f"{name}: the masks and positions its calls share are computed inside it",
                            format_graph(gm)))
    for label, graph in [("", gm)] + [(f"{name}: ", getattr(gm, name)) for name in calls_by_subgraph(gm)]:
        _prepare(graph, sym, spec, history, label)


def plan_records(gm: torch.fx.GraphModule, sym, spec, cp) -> list[RewriteRecord]:
    """The rewrite table for ``cp``'s rank, without rewriting."""
    prepare_graph(gm, sym, spec, [])
    plan = plan_with_regions(gm, sym, spec, cp, [])
    return table(plan, {node.name: i for i, node in enumerate(gm.graph.nodes)})


def table(plan: Plan, position: dict[str, int]) -> list[RewriteRecord]:
    """The graph's rows (in planning order) with each region's rows once per call, placed at the call;
    ``position`` numbers the graph's nodes by name, as planned."""
    if not plan.regions:
        return plan.records
    placed, rows = [], {call.name: [] for region in plan.regions for call in region.calls}
    for region in plan.regions:
        for row in region.rows():
            rows[row.node.split(".")[0]].append(row)
    pending = sorted(rows, key=position.get)
    for row in plan.records:
        while pending and position.get(row.node, len(position)) > position[pending[0]]:
            placed += rows[pending.pop(0)]
        placed.append(row)
    for name in pending:
        placed += rows[name]
    return placed


def _prepare(gm: torch.fx.GraphModule, sym, spec, history: list[tuple[str, str]], label: str) -> None:
    """The rewrites that put a graph in the form the rules read."""
    if drop_unread_values(gm):
        history.append((f"{label}values only metadata checks read, removed", format_graph(gm)))
    if fills_out_of_place(gm):
        history.append((f"{label}fills out of place", format_graph(gm)))
    if cropping_pads_as_slices(gm):
        history.append((f"{label}pads with negative widths as pads and slices", format_graph(gm)))
    if masked_selections_reduced(gm, sym) + means_as_sums(gm, sym) + aranges_from_zero(gm, sym) \
            + einsums_as_matmuls(gm):
        gm.recompile()
        history.append((f"{label}means as sums over counts, masked selections as masked sums, aranges from 0, "
                        f"einsums as matmuls", format_graph(gm)))
    if memory_keys_as_scores(gm, sym) + biased_sdpa_as_scores(gm, sym, spec.pad_multiple):
        history.append((f"{label}SDPA whose float mask adds a bias or whose keys hold memory, written out",
                        format_graph(gm)))
    if trimmed_losses_as_ignored_rows(gm, sym):
        history.append((f"{label}losses over trimmed rows as losses that ignore them", format_graph(gm)))
    if shifted_writes_as_shifts(gm, sym, spec.pad_multiple):
        history.append((f"{label}shifted writes as shifts", format_graph(gm)))
    if scores_bias_split(gm, sym):
        history.append((f"{label}scores and their bias apart (baddbmm)", format_graph(gm)))


def plan_with_regions(gm: torch.fx.GraphModule, sym, spec, cp, history: list[tuple[str, str]]) -> Plan:
    """Plan each nested compile region on its own, then the graph that calls them. A region whose calls do not
    match, whose plan needs the context around it, or whose operands it cannot read on its own is inlined at each
    call (noted in ``history``), and planning starts again."""
    while True:
        regions, why = [], None
        for name, calls in calls_by_subgraph(gm).items():
            sub = getattr(gm, name)
            why = mismatch(calls) or _alone(sub, calls, sym, spec, cp, regions)
            if why is not None:
                break
        if why is None:
            try:
                plan = plan_graph(gm, sym, spec, cp)
            except InlineRegion as conflict:
                name, why = conflict.name, conflict.why
            else:
                plan.regions = regions
                return plan
        count = inline(gm, name)
        history.append((f"{name} inlined at its {count} calls: {why}", format_graph(gm)))


def _alone(sub: torch.fx.GraphModule, calls: list, sym, spec, cp, regions: list) -> str | None:
    """Plan region ``sub`` on its own and add it to ``regions``; or say why it cannot be."""
    name = calls[0].args[0].target
    name_placeholders(sub, calls[0])
    blocks = [v.name for v in operands(calls[0]) if isinstance(v, torch.fx.Node) and len(seq_dims(v, sym)) >= 2]
    if blocks:
        return f"operand '{blocks[0]}' is a [seq, seq] block, built outside it"
    if not any(isinstance(meta_val(p), torch.Tensor) and seq_dims(p, sym)
               for p in sub.graph.find_nodes(op="placeholder")):
        return "it reads no sequence-sharded tensor"
    try:
        region_plan = plan_graph(sub, sym, spec, cp, module_outputs=False)
    except CPCompileError:
        return "its plan refuses it on its own; planned in place, the refusal names the model's code"
    if region_plan.partial_outputs:
        return "it returns a per-rank partial sum"
    (output,) = sub.graph.find_nodes(op="output")
    if any(isinstance(v, torch.fx.Node) and len(seq_dims(v, sym)) >= 2
           for v in torch.utils._pytree.tree_leaves(output.args[0])):
        return "it returns a [seq, seq] block"
    regions.append(Region(name, sub, calls, region_plan))
    return None


def describe_layout(spec, cp, records: list[RewriteRecord]) -> str:
    """The layout in use and why; for an automatic choice of contiguous shards, the nodes that need them."""
    layout, why = resolve_layout(spec, cp.size)
    needs = [f"{r.node} ({r.transport})" for r in records
             if r.transport in TRANSPORTS and BALANCED not in TRANSPORTS[r.transport].layouts]
    if spec.layout == AUTO and layout.kind == CONTIGUOUS and needs:
        why += f"; nodes whose transport needs it: {', '.join(needs)}"
    return f"{layout.kind} ({why})"


def run_transports(gm: torch.fx.GraphModule, plan: Plan, cp,
                   history: list[tuple[str, str]], label: str = "") -> list[tuple[Edit, RewriteRecord]]:
    """Apply each transport's rewrites in the transports' order, recording the graph after each. Returns each
    applied edit with its row of the table."""
    edits, records = [], []
    transports = in_order()
    for i, transport in enumerate(transports):
        todo = [(n, r, rec) for n, r, rec in plan.rewrites if r.transport == transport.name]
        if label and not todo:
            continue
        for node, rewrite, record in todo:
            edit = Edit(gm, node, transport.name, rewrite.rule, rank=cp.rank, world=cp.size, group_name=cp.name,
                        layout=cp.layout, keep=plan.claimed)
            transport.apply(edit, rewrite.request)
            edits.append(edit)
            records.append(record)
        later = {t.name for t in transports[i + 1:]}
        # A later transport may copy nodes an earlier one left unread (a mask's arange, now this rank's
        # positions for the rotary): they stay until it has run.
        eliminate_dead_code(gm, request_nodes(r.request for _, r, _ in plan.rewrites if r.transport in later))
        gm.graph.lint()
        gm.recompile()
        history.append((f"{label}after {transport.name} ({len(todo)} rewrites)", format_graph(gm)))
    # A rewrite whose node and edits all went dead (an arange that only fed a replaced mask) changed nothing.
    alive = set(gm.graph.nodes)
    dropped = {id(r) for e, r in zip(edits, records) if e.origin not in alive and not any(n in alive for n in e.nodes)}
    plan.records[:] = [r for r in plan.records if id(r) not in dropped]
    return list(zip(edits, records))


def verify(gm: torch.fx.GraphModule, plan: Plan, edits: list[Edit], fakes: list, before: list,
           captured: dict) -> None:
    """Every planned rewrite was applied by its transport, and every output keeps its shape. Fake tensors are
    propagated through the nodes changed since ``captured`` (:func:`..graph.propagate.snapshot` of the graph as
    captured) and whatever their new values reach."""
    alive = set(gm.graph.nodes)
    # Not applied: nothing edited, everything it made or changed is unused while the node it rewrote still
    # runs, or it created nodes and none of them is used (the values it made never reached the graph).
    skipped = [e for e in edits if not e.applied or (e.origin in alive and not any(n in alive for n in e.nodes))
               or (e.created and e.origin in alive and not any(n in alive for n in e.created))]
    if skipped or len(edits) != len(plan.rewrites):  # planning refused unregistered transports
        what = [f"{e.rule} at {op_name(e.origin)} ({source_line(e.origin, code=False)}) by transport "
                f"{e.transport!r}" for e in skipped] or ["a rewrite's transport did not run"]
        raise CPCompileError(f"cp_passes internal error: planned rewrites were not applied: {'; '.join(what)}. "
                             f"A transport's apply() must edit the graph through its Edit")
    # Under the Python dispatcher, as dynamo traced: ops sized by data-dependent counts (F.pad by an
    # indexer's top-k width) have Python meta kernels only.
    with enable_python_dispatcher():
        propagate_changed(gm, torch._guards.detect_fake_mode(fakes), fakes, captured)
    # Shapes print through the shape env, so a length the transports pinned (guards) prints the same in both;
    # sizes compare by what the shape env knows (2 * (s // 2) is s once s is known even).
    after = _output_values(gm)
    if not _same_shapes(before, after):
        raise CPCompileError(f"cp_passes internal error: the rewrite changed output shapes {_shapes(before)} -> "
                             f"{_shapes(after)}")


def _output_values(gm: torch.fx.GraphModule) -> list:
    (output,) = gm.graph.find_nodes(op="output")
    return [meta_val(v) if isinstance(v, torch.fx.Node) else v for v in torch.utils._pytree.tree_leaves(output.args[0])]


def _same_shapes(before: list, after: list) -> bool:
    if len(before) != len(after):
        return False
    for a, b in zip(before, after):
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            return False
        if not isinstance(a, torch.Tensor):
            if repr(a) != repr(b):
                return False
            continue
        if a.dim() != b.dim() or not all(statically_known_true(x == y) for x, y in zip(a.shape, b.shape)):
            return False
    return True


def _shapes(values: list) -> list[str]:
    return [str(tuple(v.shape)) if isinstance(v, torch.Tensor) else repr(v) for v in values]
