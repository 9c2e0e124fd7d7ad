"""Plan and rewrite: match every node that touches the sequence to a rule, then run the transport passes.

Planning visits every node before any rewrite, so a model is refused as a whole (every problem
listed at once) or rewritten as a whole; a half-rewritten graph never reaches the compiler.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

import torch
import torch.fx

from . import rewrites as _rewriting_rules  # noqa: F401  (importing registers them)
from .analysis import bind_args, has_symbol, meta_val, seq_dims
from .errors import CPCompileError, Problem, module_path, op_name, source_line
from .rules import _LAYOUT, Refusal, Rewrite, RuleContext, Transfer, lookup_rule

aten = torch.ops.aten

# Pass order. Positions first: they only retarget arange nodes, never attention or conv inputs.
# Halo next (causal convolutions and sliding-window attention), then full-sequence gathers, then global
# reductions (a mean's denominator). The rewrites of one pass never touch nodes another pass rewrites,
# so each graph in the history shows exactly one transport added. Doc-id transports slot in here.
PASS_ORDER = ("positions", "halo", "sequence_gather", "reductions")


@dataclass
class RewriteRecord(Transfer):
    """One row of the rewrite table: a node that a pass changed, or an output the caller must reduce."""

    node: str = ""
    op: str = ""
    source: str = ""
    module: str = ""

    @classmethod
    def of(cls, node: torch.fx.Node, transfer: Transfer, name: str | None = None) -> "RewriteRecord":
        stats = {f.name: getattr(transfer, f.name) for f in dataclasses.fields(Transfer)}
        return cls(**stats, node=name or node.name, op=op_name(node), source=source_line(node, code=False),
                   module=module_path(node))


@dataclass
class Plan:
    rewrites: list[tuple[torch.fx.Node, Rewrite]] = field(default_factory=list)
    partial_outputs: list[int] = field(default_factory=list)
    records: list[RewriteRecord] = field(default_factory=list)


_PARTIAL_LINEAR = {aten.neg, aten.clone, aten._to_copy, aten.to, aten.sum, aten.nansum, *_LAYOUT}


def _partial_rule(ctx: RuleContext, origin: torch.fx.Node) -> None:
    """A per-rank partial sum may only flow through ops that are linear in it."""
    packet = ctx.node.target.overloadpacket
    tensors = ctx.tensor_inputs()
    partial = [t for t in tensors if ctx.is_partial(t)]
    others = [t for t in tensors if not ctx.is_partial(t)]
    scalars = [a for a in ctx.node.args[1:] if isinstance(a, (int, float)) and not isinstance(a, bool)]
    ok = False
    if packet in _PARTIAL_LINEAR:
        ok = True
    elif packet is aten.mul:
        ok = len(partial) == 1 and not any(ctx.is_seq(t) for t in others)
    elif packet is aten.div:
        ok = ctx.is_partial(ctx.node.args[0]) and not any(ctx.is_partial(t) or ctx.is_seq(t) for t in others)
    elif packet in (aten.add, aten.sub):
        ok = not others and not scalars
    if not ok:
        ctx.refuse(
            f"its input is a per-rank partial sum over the sequence (from {op_name(origin)} at {source_line(origin)}); "
            f"{op_name(ctx.node)} is not linear in it, so applying it before the ranks' sums are added is wrong",
            "return the partial sum from the compiled module and add it up across ranks (dist.all_reduce) before "
            "this op",
        )
    ctx.out_partial = True


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


def plan_graph(gm: torch.fx.GraphModule, sym, spec, cp) -> Plan:
    """Match every node that touches the sequence to a rule; raise one error listing every refusal."""
    plan = Plan()
    problems: list[Problem] = []
    refused: set[torch.fx.Node] = set()
    partial: dict[torch.fx.Node, torch.fx.Node] = {}
    claimed = _claimed_by_attention(gm, sym)
    length = next(size for n in gm.graph.find_nodes(op="placeholder") if isinstance(meta_val(n), torch.Tensor)
                  for size in meta_val(n).shape if isinstance(size, torch.SymInt) and size.node.expr == sym)
    for node in gm.graph.nodes:
        if node.op != "call_function" or node in claimed:
            continue
        ctx = RuleContext(node, sym, spec, cp.rank, cp.size, cp.name, length, partial)
        try:
            rewrite = _plan_node(ctx, partial)
        except Refusal as refusal:
            problems.append(refusal.problem)
            refused.add(node)
            continue
        if ctx.out_partial:
            partial[node] = partial.get(next((t for t in ctx.tensor_inputs() if t in partial), None), node)
        if rewrite is not None:
            plan.rewrites.append((node, rewrite))
            plan.records.append(RewriteRecord.of(node, rewrite))
    problems.extend(_check_block_uses(gm, sym, refused | claimed))
    if problems:
        raise CPCompileError(problems)
    (output,) = gm.graph.find_nodes(op="output")
    flat = torch.utils._pytree.tree_leaves(output.args[0])
    for i, value in enumerate(flat):
        if isinstance(value, torch.fx.Node) and value in partial:
            origin = partial[value]
            plan.partial_outputs.append(i)
            share = Transfer("partial_sum", "none (caller sums over ranks)",
                             note="a sum over the sequence: this rank's share; add the ranks' values for the total")
            plan.records.append(RewriteRecord.of(origin, share, name=f"output[{i}]"))
    return plan


def _claimed_by_attention(gm: torch.fx.GraphModule, sym) -> set:
    """Nodes that only build an attention mask from sequence data: the attention rule evaluates them over
    the whole sequence from gathered metadata, so their own rules (a cumsum, a diff) do not apply."""
    from .rewrites import DataMask, data_mask

    consumers, nodes = {}, set()
    for node in gm.graph.find_nodes(op="call_function", target=aten.scaled_dot_product_attention.default):
        mask = bind_args(node)["attn_mask"]
        if isinstance(mask, torch.fx.Node):
            found = data_mask(mask, sym)
            if isinstance(found, DataMask):
                consumers[node] = mask
                nodes.update(found.nodes)
    claimed: set = set()
    for n in reversed(list(gm.graph.nodes)):  # users before producers
        if n in nodes and all(u in claimed or consumers.get(u) is n for u in n.users):
            claimed.add(n)
    return claimed


def _check_block_uses(gm: torch.fx.GraphModule, sym, refused: set) -> list[Problem]:
    """A tensor with two sequence dims ([q, k] scores or masks) holds only this rank's diagonal block of the
    global matrix. It may feed other such blocks and an attention mask (which the attention rule replaces),
    nothing else."""
    problems = []
    for node in gm.graph.nodes:
        if len(seq_dims(node, sym)) < 2:
            continue
        for user in node.users:
            is_mask = user.target is aten.scaled_dot_product_attention.default and bind_args(user)["attn_mask"] is node
            if is_mask or user in refused or len(seq_dims(user, sym)) >= 2:
                continue
            problems.append(Problem.at(
                user,
                f"it consumes '{node.name}', a [seq, seq] block built on one shard: each rank holds only the "
                f"diagonal block of the global matrix, not a slice of it",
                "use scaled_dot_product_attention (masks built from positions are read and rebuilt per rank)",
            ))
    return problems


def _plan_node(ctx: RuleContext, partial: dict) -> Rewrite | None:
    node = ctx.node
    tensors = ctx.tensor_inputs()
    seq_in = any(ctx.is_seq(t) for t in tensors)
    partial_in = [t for t in tensors if t in partial]
    if not isinstance(node.target, torch._ops.OpOverload):
        if node.target.__module__ == "_operator" or getattr(node.target, "__name__", "").startswith("sym_"):
            if partial_in or any(ctx.is_seq(t) for t in tensors):
                ctx.refuse("Python arithmetic on a sharded tensor", "use torch ops inside the model")
            return None  # shape arithmetic and tuple indexing
        if seq_in or partial_in or ctx.is_seq(node):
            ctx.refuse(
                f"cp_passes has no rule for {op_name(node)} and it takes a sequence-sharded input",
                "keep it outside the compiled module, or register a rule for it",
            )
        return None
    ctx.args = bind_args(node)
    if node.target.overloadpacket is not aten.arange:
        _check_length_values(ctx)
    if partial_in:
        _partial_rule(ctx, partial[partial_in[0]])
        return None
    if not seq_in and not ctx.is_seq(node):
        return None  # nothing about the sequence here
    rule = lookup_rule(node.target)
    if rule is None:
        dims = {t.name: ctx.seq_dims(t) for t in tensors if ctx.is_seq(t)}
        ctx.refuse(
            f"cp_passes has no rule for this op and it reads sequence-sharded inputs {dims} (input: sequence dims); "
            f"it may mix positions across ranks",
            "if it is position-wise, declare it with cp_passes.positionwise(op); otherwise register a rule with "
            "@cp_passes.register_rule(op), or move it outside the compiled module",
        )
    return rule(ctx)


def format_graph(gm: torch.fx.GraphModule) -> str:
    """``print_readable`` with every node a pass created or changed tagged ``# cp_passes: pass=.. rule=..``."""
    made = {n.name: (n.meta["cp_pass"], n.meta["cp_rule"]) for n in gm.graph.nodes if "cp_pass" in n.meta}
    lines = []
    for line in gm.print_readable(print_output=False).splitlines():
        m = re.match(r"\s+(\w+)(?::\s*\"[^\"]*\")?\s*=", line)
        if m and m.group(1) in made:
            pass_name, rule = made[m.group(1)]
            line = f"{line}  # cp_passes: pass={pass_name} rule={rule}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def run_passes(gm: torch.fx.GraphModule, plan: Plan, history: list[tuple[str, str]]) -> torch.fx.GraphModule:
    """Apply each transport's rewrites in ``PASS_ORDER``, recording the graph after each pass."""
    for pass_name in PASS_ORDER:
        todo = [(n, r) for n, r in plan.rewrites if r.transport == pass_name]
        for _node, rewrite in todo:
            rewrite.apply(gm, pass_name)
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
        history.append((f"after {pass_name} ({len(todo)} rewrites)", format_graph(gm)))
    # A rewrite of a node that then went dead (an arange that only fed a replaced mask) changed nothing.
    alive = {n.name for n in gm.graph.nodes}
    plan.records[:] = [r for r in plan.records if r.node in alive or r.node.startswith("output[")]
    return gm
