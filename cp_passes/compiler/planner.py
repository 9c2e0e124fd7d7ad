"""Plan: match patterns, then give every node that touches the sequence to its rule.

Planning visits every node before any rewrite, so a model is refused as a whole (every problem listed
at once) or rewritten as a whole; a half-rewritten graph never reaches the compiler. The planner tracks
each value's :class:`~cp_passes.rules.Value` (sharded along the sequence, a per-rank partial sum, or
neither) and checks that every rewrite names a registered transport that supports the layout. An op that reads
a per-rank partial sum goes to :func:`~cp_passes.rules.partial.partial_rule` instead of its own rule.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.fx

from ..errors import CPCompileError, Problem, module_path, node_ref, op_name, source_line, unrolled_loops
from ..graph.analysis import bind_args, has_symbol, meta_val, seq_dims
from ..graph.calls import INVOKE
from ..graph.narrowest import narrowest_rows, recompute_path
from ..key_plan import Move
from ..match import match_graph
from ..rules import Refusal, Rewrite, RuleContext, Value, lookup_rule, permutations
from ..rules.key_axis import KeyState, plan_keys
from ..rules.partial import partial_rule, row_counts
from ..rules.registry import ALWAYS, out_of_place, registered
from ..rules.views import table_start
from ..transports import TRANSPORTS, Cost
from ..transports.attention import FLOPS_PER_BYTE, AttentionKV, recompute_pays
from ..transports.reductions import WholeOutput
from .regions import InlineRegion

aten = torch.ops.aten


@dataclass
class RewriteRecord(Cost):
    """One row of the rewrite table: a node a transport changed, or an output the caller must reduce."""

    rule: str = ""
    transport: str = ""
    note: str = ""
    backward: str = ""
    """What the backward does with this rewrite's collectives, where cp_passes decides (``graph.checkpoint``):
    ``REPEATED`` in a checkpointed region's recomputation, ``REGATHERED`` (gathered keys not saved) or
    ``SAVED``; "" where the partitioner decides."""
    node: str = ""
    op: str = ""
    source: str = ""
    module: str = ""

    @classmethod
    def of(cls, node: torch.fx.Node, rule: str, transport: str, cost: Cost, note: str,
           name: str | None = None) -> "RewriteRecord":
        stats = {f.name: getattr(cost, f.name) for f in dataclasses.fields(Cost)}
        return cls(**stats, rule=rule, transport=transport, note=note, node=name or node.name, op=op_name(node),
                   source=source_line(node, code=False), module=module_path(node))


@dataclass(frozen=True)
class PartialOutput:
    """An output of the compiled module that is this rank's share of a sum over the sequence."""

    index: int
    """Its position among the flattened outputs."""
    value: torch.fx.Node
    origin: torch.fx.Node
    """The op that made the sum."""


@dataclass
class Plan:
    rewrites: list[tuple[torch.fx.Node, Rewrite, RewriteRecord]] = field(default_factory=list)
    """Each planned rewrite with its row in ``records``."""
    partial_outputs: list[PartialOutput] = field(default_factory=list)
    """The outputs that are per-rank partial sums, in output order."""
    records: list[RewriteRecord] = field(default_factory=list)
    claimed: frozenset = frozenset()
    """The nodes the matchers claimed: no transport rewires their inputs."""
    as_is: dict = field(default_factory=dict)
    """Nodes that read or make a sequence-sharded value and run on a shard as they are -> the inputs the
    planner brings whole for them (along a key axis)."""
    keys: dict = field(default_factory=dict)
    """Each ``[q, k]`` block of attention written by hand -> its key dim (whole on every rank)."""
    partial_sources: dict = field(default_factory=dict)
    """Each partial sum -> every op whose sum over the sequence it adds (a :class:`PartialOutput`'s ``origin``
    names the first)."""
    interleave_readers: list[str] = field(default_factory=list)
    """What would tell interleaved documents from their packed row (:mod:`.interleave`): such a batch is refused."""
    regions: list = field(default_factory=list)
    """The nested compile regions planned on their own (:class:`.regions.Region`), each with its plan."""

    def parts(self) -> list:
        """``(region, plan)`` for this graph (region None) and each region."""
        return [(None, self)] + [(region, region.plan) for region in self.regions]


def _check_length_values(ctx: RuleContext) -> None:
    """The local sequence length may size tensors, but never enter arithmetic as a value."""
    for arg in ctx.node.target._schema.arguments:
        value = ctx.args.get(arg.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        if "int" in str(arg.type):  # sizes, dims and bounds (SymInt in the schema): shape arithmetic is fine
            continue
        for v in values:
            if isinstance(v, torch.fx.Node) and has_symbol(v, ctx.sym):
                ctx.refuse(
                    f"it uses the local sequence length as a value (argument '{arg.name}'); under CP each rank's "
                    f"length is 1/{ctx.world} of the global one",
                    "pass the global length (or a global token count) in as an input, or derive it outside the "
                    "compiled module",
                )


_SIZE_ARGUMENTS = {"size", "sizes", "shape", "stride", "repeats"}
"""Integer arguments that size a tensor: a local length there makes a tensor as long as this rank's shard."""


def _check_length_positions(ctx: RuleContext) -> None:
    """The local sequence length may size tensors, but not pick rows: as the start, end, index or length of a read
    along an axis that is not the sharded sequence (``table[S // 8]``, ``pos.narrow(0, 0, S)``,
    ``pos.split([S, N - S])``), or as any other integer argument (a pad amount, a class count, a shift), every
    rank would compute it from its own length. Along the sharded axis the op's rule decides (a slice that keeps
    the whole length is fine, and the planner brings a key axis whole)."""
    src, dim = ctx.args.get("self"), ctx.args.get("dim")
    if (isinstance(src, torch.fx.Node) and isinstance(dim, int)
            and dim % max(ctx.ndim(src), 1) in seq_dims(src, ctx.sym)):
        return  # along a sequence or key axis: the op's rule decides
    if ctx.node.target is torch.ops.aten.slice.Tensor and table_start(ctx, src, dim % ctx.ndim(src)) is not None:
        return  # a table sliced to the sequence length: its rule reads this rank's rows of it
    for arg in ctx.node.target._schema.arguments:
        value = ctx.args.get(arg.name)
        values = [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, torch.fx.Node)]
        if arg.name in _SIZE_ARGUMENTS or "int" not in str(arg.type).lower():
            continue
        if any(has_symbol(v, ctx.sym) for v in values):
            along = f" along dim {dim} of a tensor that is not sharded" if isinstance(dim, int) else ""
            ctx.refuse(
                f"its argument '{arg.name}' is computed from the local sequence length "
                f"({', '.join(str(meta_val(v)) for v in values)}) and used as a position or count{along}: each rank "
                f"computes it from its own length, 1/{ctx.world} of the global one, and reads what that picks",
                "index tables with position ids (embedding(position_ids)) or an arange over the sequence, which "
                "cp_passes makes global; or pass the global length in as an input",
            )


def _returns_alias(node) -> bool:
    target = getattr(node, "target", None)
    return isinstance(target, torch._ops.OpOverload) and any(r.alias_info is not None for r in target._schema.returns)


def _check_mutation(ctx: RuleContext, write_back: bool = False) -> None:
    """An in-place op is read as the value it returns. That holds only if nothing else observes the mutated
    tensor afterwards: no view of it (taken before or after), no later reader, and it is no view or input.
    ``write_back``: reordered rows put back in their places (``out[mask] = rows`` in a loop over experts), which
    leaves the tensor what it was (rows in sequence order), so later readers and a chain of such writes are
    fine."""
    order = {n: i for i, n in enumerate(ctx.node.graph.nodes)}
    for arg in ctx.node.target._schema.arguments:
        x = ctx.args.get(arg.name)
        if arg.alias_info is None or not arg.alias_info.is_write or not isinstance(x, torch.fx.Node):
            continue
        observers = [u for u in x.users if u is not ctx.node
                     and ((order[u] > order[ctx.node] and not write_back) or _returns_alias(u))]
        chained = write_back and out_of_place(x.target) in permutations.WRITE_BACKS
        if x.op == "placeholder" or (_returns_alias(x) and not chained) or observers:
            what = ("an input of the compiled module" if x.op == "placeholder" else
                    f"a view ({op_name(x)})" if _returns_alias(x) else
                    f"also read by {', '.join(op_name(u) for u in observers)} at {source_line(observers[0])}")
            ctx.refuse(
                f"it mutates {node_ref(x)} in place, which is {what}; cp_passes reads each op's result as a value "
                f"and cannot follow the mutation to the other readers",
                "write it out of place (y = x & m instead of x &= m), or mutate a fresh tensor nothing else reads",
            )


def _check_transport(ctx: RuleContext, rewrite: Rewrite) -> None:
    transport = TRANSPORTS.get(rewrite.transport)
    if transport is None:
        raise CPCompileError(
            f"cp_passes internal error: rule {rewrite.rule!r} for {op_name(ctx.node)} at {source_line(ctx.node)} "
            f"asks for transport {rewrite.transport!r}, which is not registered (registered: {sorted(TRANSPORTS)}); "
            f"register it with cp_passes.transports.register_transport"
        )
    if ctx.layout.kind not in transport.layouts:
        ctx.refuse(f"its transport {transport.name!r} supports the layouts {transport.layouts}, not the "
                   f"{ctx.layout.kind!r} layout the spec gives ({ctx.spec.layout!r})",
                   f"set CPSpec(layout={transport.layouts[0]!r}) (shard_batch with the same spec follows it)"
                   if transport.layouts else "register the transport with the layouts it supports")


def plan_graph(gm: torch.fx.GraphModule, sym, spec, cp, module_outputs: bool = True) -> Plan:
    """Match every node that touches the sequence to a rule; raise one error listing every refusal. A call of a
    nested compile region (:mod:`.regions`, planned on its own) runs as it is; one whose operands the region cannot
    read on its own raises :class:`~.regions.InlineRegion`. ``module_outputs``: the graph's outputs are the
    compiled module's (not a region's), and a whole one passes back ``1 / P`` of its gradient."""
    plan = Plan()
    problems: list[Problem] = []
    refused: set[torch.fx.Node] = set()
    values: dict[torch.fx.Node, Value] = {}
    origins: dict[torch.fx.Node, torch.fx.Node] = {}  # a partial sum -> the op that made it
    orders: dict = {}  # rows a sort reordered, its indices and counts -> their Order
    matches = match_graph(gm, sym, spec.pad_multiple)
    keys = KeyState()
    plan.claimed = frozenset(matches.claimed)
    plan.keys = matches.blocks.keys
    length = next(size for n in gm.graph.find_nodes(op="placeholder") if isinstance(meta_val(n), torch.Tensor)
                  for size in meta_val(n).shape if isinstance(size, torch.SymInt) and size.node.expr == sym)
    for node in gm.graph.nodes:
        if node.op != "call_function" or node in matches.claimed:
            continue
        ctx = RuleContext(node, sym, spec, cp.rank, cp.size, cp.layout, length, matches, values, orders)
        if node.target is INVOKE:
            _check_region_call(ctx)
            continue
        try:
            rewrites = plan_keys(ctx, keys)
            decision = _plan_node(ctx, origins)
            rewrite = decision if isinstance(decision, Rewrite) else None
            if rewrite is not None:
                _check_transport(ctx, rewrite)
                rewrites.append((node, rewrite))
        except Refusal as refusal:
            problems.append(refusal.problem)
            refused.add(node)
            continue
        out = rewrite.output if rewrite is not None else decision
        if decision is None and (seq_dims(node, sym) or any(seq_dims(t, sym) for t in ctx.tensor_inputs())):
            plan.as_is[node] = frozenset(ctx.brought)
        if out is Value.PARTIAL:
            values[node] = Value.PARTIAL
            origins[node] = next((origins[t] for t in ctx.tensor_inputs() if t in origins), node)
            sources = [plan.partial_sources[t] for t in ctx.tensor_inputs() if t in plan.partial_sources]
            plan.partial_sources[node] = frozenset().union(*sources) or frozenset({node})
        for origin, rw in rewrites:
            if isinstance(rw.request, AttentionKV):
                _narrowest_keys(rw, sym, ctx.local_len(), plan, spec)
            cost = TRANSPORTS[rw.transport].cost(rw.request, cp.layout, cp.rank, ctx.local_len())
            plan.records.append(RewriteRecord.of(origin, rw.rule, rw.transport, cost, rw.note))
            plan.rewrites.append((origin, rw, plan.records[-1]))
    problems.extend(_check_block_uses(gm, sym, refused | matches.claimed, matches.blocks.keys))
    (output,) = gm.graph.find_nodes(op="output")
    problems.extend(Problem.at(n, f"the compiled module returns {node_ref(n)}, which holds this rank's rows in the "
                                  f"order of "
                                  f"{op_name(orders[n][0].sort if isinstance(orders[n], tuple) else orders[n].sort)} "
                                  f"(or its indices or counts): each rank orders only its own rows",
                               permutations.UNDO_FIX)
                    for n in permutations.returned(output, orders))
    if problems:
        raise CPCompileError(unrolled_loops(problems))
    flat = torch.utils._pytree.tree_leaves(output.args[0])
    for i, value in enumerate(flat):
        if module_outputs and _whole_with_gradient(value, values, sym) and value not in flat[:i]:
            note = "a value every rank holds whole, returned: its backward passes 1 / P of the gradient on each rank"
            plan.records.append(RewriteRecord.of(value, "whole_output", "reductions", Cost(
                collective="none: backward passes 1 / P of the gradient"), note, name=f"output[{i}]"))
            plan.rewrites.append((value, Rewrite("whole_output", "reductions", WholeOutput(value), note=note),
                                  plan.records[-1]))
        if isinstance(value, torch.fx.Node) and values.get(value) is Value.PARTIAL:
            plan.partial_outputs.append(PartialOutput(i, value, origins[value]))
            share = Cost(collective="none (caller sums over ranks)")
            plan.records.append(RewriteRecord.of(
                origins[value], "partial_sum", "none", share,
                "a sum over the sequence: this rank's share; add the ranks' values for the total", name=f"output[{i}]"))
    return plan


def _whole_with_gradient(value, values: dict, sym) -> bool:
    """A floating value the graph computes (it may need a gradient, which the graph as captured does not say), held
    whole on every rank (no sequence dim, no partial sum). A parameter returned as it is never leaves a graph:
    :class:`~cp_passes.compiler.backend.CPModule` shares its gradient."""
    val = meta_val(value) if isinstance(value, torch.fx.Node) else None
    return (isinstance(val, torch.Tensor) and value.op == "call_function"
            and (val.is_floating_point() or val.is_complex()) and values.get(value) is not Value.PARTIAL
            and not seq_dims(value, sym))


def _narrowest_keys(rewrite: Rewrite, sym, local_len: int, plan: Plan, spec) -> None:
    """Find what the attention's K and V derive from position by position (through the ops that run on a shard as
    they are) with the fewest bytes, positions from the layout free; where that is narrower than K and V (an MLA
    latent), it is the lower bound, and the note names it. The rows start at the embedding: token ids are not
    counted as what the first layer's keys derive from. ``spec.moved_keys`` says whether those
    tensors move in K and V's place, each rank computing K and V again on the rows it receives (causal or full
    attention; "auto": where that costs less than moving the bytes it saves, :func:`recompute_pays`)."""
    request = rewrite.request
    positions = {node for node, rw, _ in plan.rewrites if rw.transport == "positions"}

    def positionwise(n):
        return n in plan.as_is and n.target is not aten.embedding.default

    request.narrowest = narrowest_rows([request.key, request.value], sym, local_len, positionwise, positions)
    row = request.row_bytes(local_len)
    if request.narrowest.row_bytes >= row:
        return
    names = ", ".join(f"{module_path(n)} ({n.name})" if module_path(n) else n.name for n in request.narrowest.nodes)
    note = (f"{request.kv_label} derive position by position from {names}: {request.narrowest.row_bytes} B a "
            f"position against {row}, the lower bound; ")
    halo = request.plan.move == Move.HALO
    path = None if halo else recompute_path([request.key, request.value], request.narrowest, sym, local_len,
                                            positionwise, positions)
    if halo:
        note += f"cp_passes moves {request.kv_label} (a window's halo)"
    elif isinstance(path, str):
        note += f"cp_passes moves {request.kv_label}: they cannot be computed again where they arrive ({path})"
    elif spec.moved_keys == "kv":
        note += f"cp_passes moves {request.kv_label} (CPSpec.moved_keys=\"kv\")"
    else:
        pays, again, saved = recompute_pays(request, path, local_len, spec.gathered_keys == "regather")
        flops = (f"a training step computes {request.kv_label} again for {again / 1e6:.3g} MFLOP a row received "
                 f"and moves {saved:,} B less ({FLOPS_PER_BYTE * saved / 1e6:.3g} MFLOP at {FLOPS_PER_BYTE:,} FLOP "
                 f"a byte)")
        if pays or spec.moved_keys == "narrowest":
            request.recompute = path
            note += f"cp_passes moves those: {flops}"
        else:
            note += f"cp_passes moves {request.kv_label}: {flops} (CPSpec.moved_keys=\"narrowest\" moves those)"
    rewrite.note += ("; " if rewrite.note else "") + note


def _check_region_call(ctx: RuleContext) -> None:
    """A region planned on its own sees its operands as plain values: sharded rows, or whole."""
    for t in ctx.tensor_inputs():
        why = ("a per-rank partial sum" if ctx.is_partial(t) else
               "a value a pattern matcher claimed" if t in ctx.matches.claimed else
               "a [q, k] block of attention scores" if t in ctx.matches.blocks.keys else
               "a [seq, seq] block" if len(seq_dims(t, ctx.sym)) >= 2 else None)
        if why is not None:
            raise InlineRegion(ctx.node.args[0].target, f"operand {node_ref(t)} is {why}")


def _check_block_uses(gm: torch.fx.GraphModule, sym, refused: set, keys: dict) -> list[Problem]:
    """A tensor with two sequence dims and no key axis (not a hand-written attention's ``[q, k]`` block)
    holds only this rank's diagonal block of the global matrix. It may feed other such tensors and an
    attention mask (which the attention rule replaces), nothing else; a block is not returned."""
    problems = []
    for node in gm.graph.nodes:
        if node.op == "output":
            problems += [Problem.at(n, f"the compiled module returns {node_ref(n)}, a [q, k] block of attention "
                                       f"scores, which under CP holds every key for this rank's queries",
                                    "return what attention computes from the scores, not the scores")
                         for n in torch.utils._pytree.tree_leaves(node.args[0]) if n in keys]
        if len(seq_dims(node, sym)) < 2 or node in keys:
            continue
        for user in node.users:
            is_mask = user.target is aten.scaled_dot_product_attention.default and bind_args(user)["attn_mask"] is node
            if is_mask or user in refused or len(seq_dims(user, sym)) >= 2:
                continue
            problems.append(Problem.at(
                user,
                f"it consumes {node_ref(node)}, a [seq, seq] block built on one shard: each rank holds only the "
                f"diagonal block of the global matrix, not a slice of it",
                "use scaled_dot_product_attention (masks built from positions are read and rebuilt per rank)",
            ))
    return problems


def _plan_node(ctx: RuleContext, origins: dict):
    node = ctx.node
    tensors = ctx.tensor_inputs()
    seq_in = any(ctx.is_seq(t) for t in tensors)
    partial_in = [t for t in tensors if ctx.is_partial(t)]
    if not isinstance(node.target, torch._ops.OpOverload):
        permutations.getitem(node, ctx.orders)
        if node.target.__module__ == "_operator" or getattr(node.target, "__name__", "").startswith("sym_"):
            if partial_in or seq_in:
                ctx.refuse("Python arithmetic on a sharded tensor", "use torch ops inside the model")
            return None  # shape arithmetic and tuple indexing
        if seq_in or partial_in or ctx.is_seq(node):
            ctx.refuse(
                f"cp_passes has no rule for {op_name(node)} and it takes a sequence-sharded input",
                "keep it outside the compiled module, or register a rule for it",
            )
        return None
    ctx.args = bind_args(node)
    counts = row_counts(ctx)
    if node.target.overloadpacket is not aten.arange and not counts:
        _check_length_values(ctx)
    mutates = node.target._schema.is_mutable and (seq_in or partial_in or ctx.is_seq(node))
    reordered = permutations.involved(ctx)
    if mutates:
        _check_mutation(ctx, write_back=reordered and permutations.writes_back(ctx))
    if partial_in and not reordered:
        return partial_rule(ctx, origins[partial_in[0]], counts)
    if not seq_in and not ctx.is_seq(node) and node.target not in ALWAYS and not reordered:
        if node.target.overloadpacket is not aten.arange:
            _check_length_positions(ctx)
        return None  # nothing about the sequence here
    rule = permutations.plan if reordered else lookup_rule(node.target)
    if rule is None:
        dims = ", ".join(f"input {i} on dims {ctx.seq_dims(t)}" for i, t in enumerate(tensors) if ctx.is_seq(t))
        ctx.refuse(
            f"cp_passes has no rule for this op and it reads the sequence ({dims}); it may mix positions across "
            f"ranks",
            "if it is position-wise, declare it with cp_passes.positionwise(op); otherwise register a rule with "
            "@cp_passes.register_rule(op), or move it outside the compiled module",
        )
    decision = rule(ctx)
    if node.target.overloadpacket is not aten.arange:
        _check_length_positions(ctx)
    if isinstance(decision, Rewrite) and out_of_place(node.target) is not None and not registered(node.target):
        ctx.refuse(f"it is the in-place form of {out_of_place(node.target)}, which needs the {decision.transport} "
                   f"transport; a transport rewrites values, not a tensor mutated in place",
                   f"write it out of place (x = {out_of_place(node.target).overloadpacket.__name__}(x, ...))")
    return decision
