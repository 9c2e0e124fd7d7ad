"""Repeated layers planned once: dynamo's nested compile regions (``invoke_subgraph``).

A model whose block class is marked ``torch.compiler.nested_compile_region`` (by the user, or by
``cp_compile(regions=True)`` through :func:`mark_regions`) reaches the backend with one subgraph per distinct
block and a call of it per layer. Each distinct subgraph is planned and rewritten once, as a graph of its own,
and every call runs the rewritten one. That holds only where every call hands the subgraph the same kind of
values, so the match is checked, not assumed: the calls' operands must agree (:func:`call_signature`: shapes,
dtypes, which inputs they are), none may be a value the subgraph cannot read on its own (a per-rank partial
sum, a ``[seq, seq]`` block, a value a matcher claimed), and the subgraph's plan must return no partial sum.
A subgraph that fails any of these is inlined at each call, and the whole graph is planned as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.fx

from ..errors import module_path
from ..graph.analysis import INPUT_NAME, meta_val
from ..graph.calls import INVOKE, call_signature, calls_by_subgraph, operands


class InlineRegion(Exception):
    """Raised by the planner at a call whose operands the subgraph cannot read on its own."""

    def __init__(self, name: str, why: str):
        super().__init__(f"{name}: {why}")
        self.name, self.why = name, why


def mismatch(calls: list[torch.fx.Node]) -> str | None:
    """Why the calls cannot share one plan, or None."""
    first = call_signature(calls[0])
    for call in calls[1:]:
        other = call_signature(call)
        if other != first:
            at = next((i for i, (a, b) in enumerate(zip(first, other)) if a != b), len(first))
            return (f"its calls differ at operand {at}: {first[at] if at < len(first) else '-'} "
                    f"({module_path(calls[0])}) vs {other[at] if at < len(other) else '-'} ({module_path(call)})")
    return None


def name_placeholders(sub: torch.fx.GraphModule, call: torch.fx.Node) -> None:
    """The subgraph's placeholders take the model-input names of the operands that are model inputs."""
    for placeholder, value in zip(sub.graph.find_nodes(op="placeholder"), operands(call)):
        placeholder.meta.pop(INPUT_NAME, None)
        if isinstance(value, torch.fx.Node) and value.op == "placeholder" and INPUT_NAME in value.meta:
            placeholder.meta[INPUT_NAME] = value.meta[INPUT_NAME]


def inline(gm: torch.fx.GraphModule, name: str) -> int:
    """Replace every call of subgraph ``name`` by a copy of its nodes; returns how many calls were inlined."""
    calls = calls_by_subgraph(gm).get(name, [])
    sub = getattr(gm, name)
    traced = _block_path(calls[0]) if calls else None  # the subgraph's modules are the first call's
    attributes = {}  # what the subgraph's get_attr and call_module nodes read, under a name free in gm
    for node in [n for n in sub.graph.nodes if n.op in ("get_attr", "call_module")]:
        free, i = node.target.replace(".", "_"), 0
        while hasattr(gm, free):
            i += 1
            free = f"{node.target.replace('.', '_')}_{name}_{i}"
        value = sub.get_submodule(node.target) if node.op == "call_module" else getattr(sub, node.target)
        gm.add_submodule(free, value) if isinstance(value, torch.nn.Module) else setattr(gm, free, value)
        attributes[node.target] = free
    for call in calls:
        env = dict(zip(sub.graph.find_nodes(op="placeholder"), operands(call)))
        (output,) = sub.graph.find_nodes(op="output")
        here = _block_path(call)
        with gm.graph.inserting_before(call):
            for node in sub.graph.nodes:
                if node.op in ("placeholder", "output"):
                    continue
                env[node] = copy = gm.graph.node_copy(node, lambda n: env[n])
                if node.target in attributes and node.op in ("get_attr", "call_module"):
                    copy.target = attributes[node.target]
                if traced and here and "nn_module_stack" in copy.meta:
                    copy.meta["nn_module_stack"] = {
                        key: ((here + path[len(traced):], cls) if path.startswith(traced) else (path, cls))
                        for key, (path, cls) in copy.meta["nn_module_stack"].items()}
        results = [env[v] if isinstance(v, torch.fx.Node) else v for v in output.args[0]]
        for user in list(call.users):  # dynamo reads a call's results by getitem only
            user.replace_all_uses_with(results[user.args[1]])
            gm.graph.erase_node(user)
        getter = call.args[0]
        gm.graph.erase_node(call)
        if not getter.users:
            gm.graph.erase_node(getter)
    if not gm.graph.find_nodes(op="get_attr", target=name):
        delattr(gm, name)
    gm.graph.lint()
    gm.recompile()
    return len(calls)


def inline_writing_regions(gm: torch.fx.GraphModule) -> list[str]:
    """Inline, at each of its calls, every region of dynamo's graph ``gm`` that writes one of its operands in place
    (a block counting its calls in a buffer, BatchNorm's running statistics): torch's ``invoke_subgraph`` cannot
    train through such a write, and cp_passes chose the region, not the user. The write is found by running the
    region's subgraph once on fake copies of its first call's operands and reading their version counters, so
    writes inside an op (``batch_norm(training=True)``) count too. Returns one line per region inlined, naming
    what it writes."""
    lines = []
    for name, calls in calls_by_subgraph(gm).items():
        written = _written_operands(getattr(gm, name), calls[0])
        if written:
            count = inline(gm, name)
            lines.append(f"{name} inlined at its {count} calls: it writes {', '.join(written)} in place, which a "
                         f"nested compile region cannot train through")
    return lines


def _written_operands(sub: torch.fx.GraphModule, call: torch.fx.Node) -> list[str]:
    """The operands of ``call`` that running ``sub`` on them writes in place, each by the name dynamo's source gives
    it (``L['self']._modules['layers']._modules['0']._buffers['calls']``)."""
    values = [meta_val(p) for p in sub.graph.find_nodes(op="placeholder")]
    fake_mode = next((v.fake_mode for v in values if isinstance(v, torch._subclasses.FakeTensor)), None)
    if fake_mode is None:
        return []
    try:
        with fake_mode, torch.no_grad():
            copies = [v.detach().clone() if isinstance(v, torch.Tensor) else v for v in values]
            versions = [c._version if isinstance(c, torch.Tensor) else None for c in copies]
            sub(*copies)
    except Exception:  # a probe only: where it cannot run, the re-trace reports what torch refuses, as before
        return []
    written = []
    for operand, copy, version in zip(operands(call), copies, versions):
        if version is not None and copy._version != version:
            source = operand.meta.get("grapharg") if isinstance(operand, torch.fx.Node) else None
            written.append(source.source.name if source is not None else str(operand))
    return written


def _block_path(call: torch.fx.Node) -> str | None:
    """The module path (as dynamo spells it) of the block a call runs."""
    stack = call.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else None


def stamp_regions(gm: torch.fx.GraphModule) -> int:
    """Inline every region, rewritten once, at each of its calls; returns how many regions there were. For
    Inductor: torch 2.13's Inductor on CPU computes wrong gradients for a region called more than once (plain
    ``torch.compile`` of the 4-layer ToyLlama with its block a nested compile region: the last block's RMSNorm
    weight off by 29% relative, with or without cp_passes; likely pytorch/pytorch#193960). The same plain test on
    an H200 with torch 2.11 matched eager (6.6e-7); torch 2.13 on CUDA is untested, so regions are stamped out for
    Inductor on every device: they save cp_passes' planning there, not Inductor's time."""
    names = list(calls_by_subgraph(gm))
    for name in names:
        inline(gm, name)
    return len(names)


def module_at_call(call: torch.fx.Node, first: torch.fx.Node, path: str) -> str:
    """``path``, a module inside the first call's block, as the same module inside ``call``'s block."""
    base, here = module_path(first), module_path(call)
    if base and path.startswith(base):
        return here + path[len(base):]
    return path


_SUBCLASSES: dict[type, type] = {}

_NONE_SHAPE = (0,) * 8
"""A None the region returned, as an empty 8-dimensional uint8 tensor (a shape no layer returns)."""


def _tensors_out(forward):
    """``forward`` returning tensors only: dynamo traces a region once for all its calls only where it returns a
    tensor or a tuple of tensors, and decoder layers return ``(hidden_states, None)`` (GLM5-Next's layers without
    an indexer: each was traced again, 45 times). A None in a returned tuple goes out as an empty marker tensor
    and :func:`_nones_back` puts it back outside the region."""

    @functools.wraps(forward)
    def region(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if isinstance(out, tuple) and any(o is None for o in out) and all(
                o is None or isinstance(o, torch.Tensor) for o in out):
            device = next((o.device for o in out if o is not None), None)
            return tuple(torch.empty(_NONE_SHAPE, dtype=torch.uint8, device=device) if o is None else o for o in out)
        return out

    return region


MAX_TRACES = 256
"""Subgraphs dynamo may keep for the regions' wrapper (torch's default is 8). The wrapper's code is the same for
every block class, so each class and each variant of one whose guards differ between layers takes an entry:
Zamba2's 54 layers (Mamba layers and hybrid layers calling a shared block) exceed 8, and past the limit dynamo
raises instead of tracing again."""


def _nones_back(forward):
    region = torch.compiler.nested_compile_region(_tensors_out(forward), max_reuse_entries=MAX_TRACES)

    @functools.wraps(forward)
    def marked(self, *args, **kwargs):
        out = region(self, *args, **kwargs)
        if isinstance(out, tuple):
            return tuple(None if isinstance(o, torch.Tensor) and o.shape == _NONE_SHAPE and o.dtype == torch.uint8
                         else o for o in out)
        return out

    return marked


def repeated_blocks(model: torch.nn.Module) -> list[type]:
    """The classes of the blocks a model repeats: the children of a ``ModuleList`` that holds at least two
    modules of one class (transformer layers), as accelerate's regional compilation finds them."""
    found: list[type] = []
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            classes = [type(child) for child in module]
            for cls in dict.fromkeys(classes):
                if classes.count(cls) >= 2 and cls not in found:
                    found.append(cls)
    return found


def mark_regions(model: torch.nn.Module, classes) -> list[str]:
    """Make every instance of ``classes`` (a class or class name) a nested compile region: its class becomes a
    subclass whose ``forward`` is ``torch.compiler.nested_compile_region(forward)`` (the user's class is left as it
    is; ``isinstance`` still holds). Returns the names of the classes marked."""
    wanted = list(classes)
    names = {c for c in wanted if isinstance(c, str)}
    types = tuple(c for c in wanted if isinstance(c, type))
    marked = []
    for module in model.modules():
        cls = type(module)
        base = next((b for b, sub in _SUBCLASSES.items() if sub is cls), cls)
        if not (isinstance(module, types) and types) and base.__name__ not in names:
            continue
        if cls is base:
            if base not in _SUBCLASSES:
                _SUBCLASSES[base] = type(base.__name__, (base,), {
                    "forward": _nones_back(base.forward),
                    "__module__": base.__module__, "__qualname__": base.__qualname__})
            module.__class__ = _SUBCLASSES[base]
        if base.__name__ not in marked:
            marked.append(base.__name__)
    return marked


class Region:
    """A nested compile region planned on its own: its subgraph, the calls that run it, and its plan."""

    def __init__(self, name: str, graph: torch.fx.GraphModule, calls: list[torch.fx.Node], plan):
        self.name, self.graph, self.calls, self.plan = name, graph, calls, plan

    def fakes(self) -> list:
        return [meta_val(p) for p in self.graph.graph.find_nodes(op="placeholder")]

    def rows(self) -> list:
        """The plan's rows of the rewrite table once per call, each under its call's module (``layers.5.attn``)."""
        return [dataclasses.replace(row, node=f"{call.name}.{row.node}",
                                    module=module_at_call(call, self.calls[0], row.module))
                for call in self.calls for row in self.plan.records]


def flatten_nested(sub: torch.fx.GraphModule) -> None:
    """Inline the regions a region calls: a region is planned as one graph."""
    for name in list(calls_by_subgraph(sub)):
        flatten_nested(getattr(sub, name))
        inline(sub, name)


@contextlib.contextmanager
def schema_once():
    """Trace each region's schema once per subgraph. Under autograd, every call of ``invoke_subgraph`` re-traces its
    subgraph to learn whether it mutates an input (``HigherOrderOperator.gen_schema``, a third of a second per call
    of a Llama-8B block on fake tensors): the answer is the subgraph's, the same at every call."""
    original = INVOKE.gen_schema
    seen: dict = {}

    def once(subgraph, identifier, *operands):
        # By name where the call has one: AOTAutograd wraps the same subgraph anew at every call.
        key = (identifier if identifier is not None else id(subgraph),
               tuple((str(o.shape), o.dtype, o.requires_grad) if isinstance(o, torch.Tensor) else type(o)
                     for o in operands))
        if key not in seen:
            seen[key] = original(subgraph, identifier, *operands)
        return seen[key]

    INVOKE.gen_schema = once
    try:
        yield
    finally:
        del INVOKE.gen_schema


def mark_gradients(gm: torch.fx.GraphModule, inputs: list) -> None:
    """Mark which of each region's results need a gradient, for AOTAutograd, which reads it from the subgraph's
    output values (``invoke_subgraph.get_output_metadata``): the pre-dispatch re-trace records every value as
    needing none. A result needs one where it depends on an operand that does, at any call; ``inputs`` are the
    graph's example inputs."""
    needs = {p: isinstance(x, torch.Tensor) and x.requires_grad
             for p, x in zip(gm.graph.find_nodes(op="placeholder"), inputs)}
    calls = calls_by_subgraph(gm)
    operand_needs = {name: [False] * len(operands(found[0])) for name, found in calls.items()}
    _flow(gm.graph, needs)
    for name, found in calls.items():
        for call in found:
            for i, value in enumerate(operands(call)):
                operand_needs[name][i] |= bool(needs.get(value, False))
    for name, flags in operand_needs.items():
        sub = getattr(gm, name)
        inner = dict(zip(sub.graph.find_nodes(op="placeholder"), flags))
        _flow(sub.graph, inner)
        (output,) = sub.graph.find_nodes(op="output")
        for value in output.args[0]:
            val = meta_val(value) if isinstance(value, torch.fx.Node) else None
            if isinstance(val, torch.Tensor) and val.requires_grad != inner.get(value, False):
                value.meta["val"] = val.detach().requires_grad_(inner.get(value, False))


def _flow(graph: torch.fx.Graph, needs: dict) -> None:
    """Whether each value depends on one that needs a gradient (floating point; ``detach`` cuts)."""
    for node in graph.nodes:
        if node in needs or node.op != "call_function":
            continue
        val = meta_val(node)
        floating = not isinstance(val, torch.Tensor) or val.is_floating_point() or val.is_complex()
        needs[node] = floating and node.target is not torch.ops.aten.detach.default and any(
            needs.get(a, False) for a in node.all_input_nodes)


def constants_as_factories(sub: torch.fx.GraphModule) -> bool:
    """A tensor a region's code creates from data (``torch.tensor([])`` in transformers' KV cache) is a constant of
    its subgraph, which AOTAutograd's trace of the region turns fake and then refuses. An empty one becomes the
    op that makes it (``aten.empty``). False where a constant holds data (the region is then inlined, where
    constants stay real)."""
    for node in list(sub.graph.find_nodes(op="get_attr")):
        value = getattr(sub, node.target)
        if not isinstance(value, torch.Tensor):
            continue
        if value.numel():
            return False
        with sub.graph.inserting_before(node):
            empty = sub.graph.call_function(torch.ops.aten.empty.memory_format, (list(value.shape),),
                                            {"dtype": value.dtype, "device": value.device})
        empty.meta = dict(node.meta)
        node.replace_all_uses_with(empty)
        sub.graph.erase_node(node)
        delattr(sub, node.target)
    sub.recompile()
    return True


def _mask_program(value: torch.fx.Node) -> tuple[list[torch.fx.Node], list[torch.fx.Node]] | None:
    """The nodes that compute ``value`` (in graph order) and the graph inputs they read, where ``value`` is a
    pure function of the sequence length and the model's integer inputs (positions, document ids, a padding
    mask): a mask a model builds once and hands every layer. None where it reads anything else (a parameter,
    an activation, a constant, an op that mutates or draws random numbers)."""
    nodes, leaves, stack, seen = [], [], [value], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            val = meta_val(node)
            if isinstance(val, torch.Tensor) and (val.is_floating_point() or val.requires_grad):
                return None
            leaves.append(node)
            continue
        target = node.target
        if node.op != "call_function" or target is INVOKE or not isinstance(target, torch._ops.OpOverload):
            return None
        if target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags:
            return None
        nodes.append(node)
        stack.extend(node.all_input_nodes)
    order = {node: i for i, node in enumerate(value.graph.nodes)}
    return sorted(nodes, key=order.get), sorted(leaves, key=order.get)


def _same_program(first: tuple, other: tuple) -> bool:
    """Whether two programs compute the same value: the same ops on the same inputs, node for node."""
    (nodes, leaves), (other_nodes, other_leaves) = first, other
    if leaves != other_leaves or len(nodes) != len(other_nodes):
        return False
    to_first = dict(zip(other_nodes, nodes))

    def same(value):
        return to_first.get(value, value) if isinstance(value, torch.fx.Node) else value

    return all(a.target == b.target and torch.fx.node.map_aggregate(b.args, same) == a.args
               and torch.fx.node.map_aggregate(b.kwargs, same) == a.kwargs for a, b in zip(nodes, other_nodes))


def masks_into_region(gm: torch.fx.GraphModule, name: str, sequence_dims) -> int:
    """Move the masks a region's calls are handed into the region. An operand every call passes the same value
    for (one node, or nodes that compute it alike) is computed inside the subgraph instead, from what computes
    it, where it is a ``[seq, seq]`` block computed from the sequence length and integer inputs only (DeepSeek
    V4 builds its masks once and hands them to every layer), or integer positions computed from the length
    alone (an ``arange``: inside, the rules know them as positions; as an operand they would be metadata to
    gather). The region then plans its mask as a whole model does (at its rank's rows, cut to the keys
    brought). Returns how many operands moved; ``sequence_dims(node)`` are a value's sequence dims."""
    calls = calls_by_subgraph(gm).get(name, [])
    sub = getattr(gm, name)
    moved, outside = 0, set()
    for index in reversed(range(len(operands(calls[0])) if calls else 0)):
        value = operands(calls[0])[index]
        if not (isinstance(value, torch.fx.Node) and isinstance(meta_val(value), torch.Tensor)):
            continue
        dims, program = sequence_dims(value), _mask_program(value)
        if not dims or program is None:
            continue
        nodes, leaves = program
        positions = not meta_val(value).is_floating_point() and not any(
            isinstance(meta_val(leaf), torch.Tensor) for leaf in leaves)
        if len(dims) < 2 and not positions:
            continue
        others = [operands(call)[index] for call in calls[1:]]
        if not all(isinstance(other, torch.fx.Node) for other in others):
            continue
        copies = [_mask_program(other) for other in others if other is not value]
        if not all(found is not None and _same_program(program, found) for found in copies):
            continue
        outside.update(nodes, *(found[0] for found in copies))
        placeholders = list(sub.graph.find_nodes(op="placeholder"))
        env = {}
        with sub.graph.inserting_after(placeholders[-1]):
            for leaf in reversed(leaves):
                known = [i for i, v in enumerate(operands(calls[0])) if v is leaf]
                if known:
                    env[leaf] = placeholders[known[0]]
                    continue
                env[leaf] = added = sub.graph.placeholder(f"{leaf.name}_for_mask")
                added.meta = dict(leaf.meta)
        first = next(n for n in sub.graph.nodes if n.op != "placeholder")
        with sub.graph.inserting_before(first):
            for node in nodes:
                env[node] = sub.graph.node_copy(node, lambda n: env[n])
        placeholders[index].replace_all_uses_with(env[value])
        sub.graph.erase_node(placeholders[index])
        added = [leaf for leaf in leaves if not any(v is leaf for v in operands(calls[0]))]
        for call in calls:
            rest = list(operands(call))
            del rest[index]
            call.args = (*call.args[:2], *rest, *added)
        moved += 1
    if moved:
        for node in reversed(list(gm.graph.nodes)):  # what only the moved masks read
            if node in outside and not node.users:
                gm.graph.erase_node(node)
        sub.graph.lint()
        sub.recompile()
        gm.graph.lint()
        gm.recompile()
    return moved
