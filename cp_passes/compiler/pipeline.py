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
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from ..errors import CPCompileError, op_name, source_line
from ..graph.analysis import meta_val, sequence_symbol
from ..graph.checkpoint import tag_transport
from ..graph.fills import fills_out_of_place
from ..graph.scores_bias import scores_bias_split
from ..graph.shifted_writes import shifted_writes_as_shifts
from ..graph.provenance import Edit, eliminate_dead_code, format_graph
from ..layout import AUTO, BALANCED, CONTIGUOUS, resolve_layout
from ..transports import TRANSPORTS, in_order
from .guards import check_length_guards
from .interleave import interleave_readers
from .planner import Plan, RewriteRecord, plan_graph


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


def rewrite_graph(aten_gm: torch.fx.GraphModule, fakes: list, spec, cp, record: CompileRecord) -> Plan:
    """analyse -> match -> plan -> guards on the length -> transports -> verify. Records every stage in
    ``record``; raises CPCompileError on refusal."""
    sym = find_symbol(aten_gm, record.local_len)
    record.history.append(("aten (pre-dispatch)", aten_gm.print_readable(print_output=False)))
    if fills_out_of_place(aten_gm):
        record.history.append(("fills out of place", format_graph(aten_gm)))
    if shifted_writes_as_shifts(aten_gm, sym, spec.pad_multiple):
        record.history.append(("shifted writes as shifts", format_graph(aten_gm)))
    if scores_bias_split(aten_gm, sym):
        record.history.append(("scores and their bias apart (baddbmm)", format_graph(aten_gm)))
    before = _output_values(aten_gm)
    plan = plan_graph(aten_gm, sym, spec, cp)
    plan.interleave_readers = record.interleave_readers = interleave_readers(plan, spec)
    check_length_guards(torch._guards.detect_fake_mode(fakes).shape_env, sym, cp.size)
    record.records = plan.records
    record.layout = describe_layout(spec, cp, plan)
    record.partial_outputs = plan.partial_outputs
    done = run_transports(aten_gm, plan, cp, record.history)
    verify(aten_gm, plan, [edit for edit, _ in done], fakes, before)
    regather = spec.gathered_keys == "regather"
    for edit, rewrite in done:  # after verify: the scalar test reads the values it propagated
        rewrite.backward = tag_transport(edit, regather and TRANSPORTS[edit.pass_name].gathers_keys)
    return plan


def describe_layout(spec, cp, plan: Plan) -> str:
    """The layout in use and why; for an automatic choice of contiguous shards, the nodes that need them."""
    layout, why = resolve_layout(spec, cp.size)
    needs = [f"{r.node} ({r.transport})" for r in plan.records
             if r.transport in TRANSPORTS and BALANCED not in TRANSPORTS[r.transport].layouts]
    if spec.layout == AUTO and layout.kind == CONTIGUOUS and needs:
        why += f"; nodes whose transport needs it: {', '.join(needs)}"
    return f"{layout.kind} ({why})"


def run_transports(gm: torch.fx.GraphModule, plan: Plan, cp,
                   history: list[tuple[str, str]]) -> list[tuple[Edit, RewriteRecord]]:
    """Apply each transport's rewrites in the transports' order, recording the graph after each. Returns each
    applied edit with its row of the table."""
    edits, records = [], []
    for transport in in_order():
        todo = [(n, r, rec) for n, r, rec in plan.rewrites if r.transport == transport.name]
        for node, rewrite, record in todo:
            edit = Edit(gm, node, transport.name, rewrite.rule, rank=cp.rank, world=cp.size, group_name=cp.name,
                        layout=cp.layout, keep=plan.claimed)
            transport.apply(edit, rewrite.request)
            edits.append(edit)
            records.append(record)
        eliminate_dead_code(gm)
        gm.graph.lint()
        gm.recompile()
        history.append((f"after {transport.name} ({len(todo)} rewrites)", format_graph(gm)))
    # A rewrite whose node and edits all went dead (an arange that only fed a replaced mask) changed nothing.
    alive = set(gm.graph.nodes)
    dropped = {id(r) for e, r in zip(edits, records) if e.origin not in alive and not any(n in alive for n in e.nodes)}
    plan.records[:] = [r for r in plan.records if id(r) not in dropped]
    return list(zip(edits, records))


def verify(gm: torch.fx.GraphModule, plan: Plan, edits: list[Edit], fakes: list, before: list) -> None:
    """Every planned rewrite was applied by its transport, and every output keeps its shape."""
    alive = set(gm.graph.nodes)
    # Not applied: nothing edited, everything it made or changed is unused while the node it rewrote still
    # runs, or it created nodes and none of them is used (the values it made never reached the graph).
    skipped = [e for e in edits if not e.applied or (e.origin in alive and not any(n in alive for n in e.nodes))
               or (e.created and e.origin in alive and not any(n in alive for n in e.created))]
    if skipped or len(edits) != len(plan.rewrites):  # planning refused unregistered transports
        what = [f"{e.rule} at {op_name(e.origin)} ({source_line(e.origin, code=False)}) by transport "
                f"{e.pass_name!r}" for e in skipped] or ["a rewrite's transport did not run"]
        raise CPCompileError(f"cp_passes internal error: planned rewrites were not applied: {'; '.join(what)}. "
                             f"A transport's apply() must edit the graph through its Edit")
    # Under the Python dispatcher, as dynamo traced: ops sized by data-dependent counts (F.pad by an
    # indexer's top-k width) have Python meta kernels only.
    with enable_python_dispatcher():
        FakeTensorProp(gm, torch._guards.detect_fake_mode(fakes)).propagate_dont_convert_inputs(*fakes)
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
