"""Capture: dynamo's torch-level graph re-traced to pre-dispatch ATen, with one proven sequence symbol.

The wrapper marks the sequence dim of every sharded input dynamic. Before anything is planned, this step
proves that the data really flows through a symbolic length: every sharded input's sequence dim must be
the one sequence symbol after tracing. If code in the model turned the length into a constant (a
loop over chunks, an ``int()``, a reshape to a fixed size), the graph would be right for one length only
and the analysis would not see the sequence at all, so the model is refused, naming the line that did it.
"""

from __future__ import annotations

import operator

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx

from ..errors import CPCompileError, source_line
from ..graph.analysis import INPUT_NAME, meta_val
from .regions import inline_writing_regions, schema_once

_KEEP_SYMBOLIC = (
    "keep the sequence length symbolic there (no Python loop over chunks of the sequence, no int() of a size, "
    "no reshape to a fixed length); for a recurrent kernel, run it outside the compiled module. "
    "TORCH_LOGS=\"+dynamic\" shows every guard on the length"
)


_LOGGER_METHODS = ("debug", "info", "warning", "warn", "error", "critical", "exception", "log",
                   "warning_once", "info_once", "warning_advice")  # the last three: transformers' additions


def tracing_config():
    """The dynamo config patch cp_passes traces a model under.

    - The model's calls of ``logging.Logger`` methods trace as no-ops, as they do under ``torch.export``: a log
      line cannot change a value, and dynamo otherwise stops at it (transformers' ``logger.warning_once`` in
      ``loss_function`` when a config's ``loss_type`` is None: GPT-2 with ``labels=``). The messages are not
      printed from the compiled graph.
    - Fake tensors without their dispatch cache: with the sequence length symbolic, each cache hit rebuilt its
      output through symbolic size arithmetic, and a compile ran 9% longer with it (DeepSeek V4's parity task).
    """
    import logging

    methods = {getattr(logging.Logger, name) for name in _LOGGER_METHODS if hasattr(logging.Logger, name)}
    return torch._dynamo.config.patch(ignore_logging_functions=torch._dynamo.config.ignore_logging_functions | methods,
                                      fake_tensor_cache_enabled=False)


def sharded_placeholders(gm: torch.fx.GraphModule,
                         sharded: dict[int, tuple[str, int]]) -> list[tuple[torch.fx.Node, tuple[str, int]]]:
    """Dynamo's placeholders for the sharded inputs (``sharded`` maps ``id(tensor)`` to the input's name and
    sequence dim)."""
    found = []
    for node in gm.graph.find_nodes(op="placeholder"):
        grapharg = node.meta.get("grapharg")
        example = getattr(grapharg, "example", None) if grapharg is not None else None
        if isinstance(example, torch.Tensor) and id(example) in sharded:
            found.append((node, sharded[id(example)]))
    return found


def _where_specialized(shape_env, source_name: str) -> str:
    """Where dynamo turned the size ``source_name`` into a constant, as far as the shape env recorded it."""
    for sym, sources in shape_env.var_to_sources.items():
        if any(s.name == source_name for s in sources):
            sloc = shape_env.replacements_slocs.get(sym)
            if sloc is not None:
                return str(sloc)
    return "during dynamo's capture"


class _Retracer(torch.fx.Interpreter):
    """Runs dynamo's graph under make_fx and remembers the node at which the sequence symbol became a constant."""

    def __init__(self, gm: torch.fx.GraphModule, shape_env, sym):
        super().__init__(gm)
        self.shape_env, self.sym = shape_env, sym
        self.specialized_at: torch.fx.Node | None = None

    def run_node(self, n: torch.fx.Node):
        out = super().run_node(n)
        if self.specialized_at is None and self.sym is not None and self.shape_env.replace(self.sym).is_number:
            self.specialized_at = n
        return out


def _seq_size(node: torch.fx.Node, seq_dim: int):
    val = meta_val(node)
    return val.shape[seq_dim] if isinstance(val, torch.Tensor) and val.dim() > seq_dim else None


def _specialized_error(name: str, length: int, where: str) -> CPCompileError:
    return CPCompileError(
        f"the tracer specialized the local sequence length of input {name!r} to {length} at {where}: that code "
        f"turns the length into a Python int, so the compiled graph would hold for this length only and cp_passes "
        f"could not tell positions from sizes (the model would run on each shard with no exchange). Fix: "
        + _KEEP_SYMBOLIC
    )


def _refuse_custom_backwards(gm: torch.fx.GraphModule) -> None:
    """A ``torch.autograd.Function`` reaches the backend as dynamo's ``autograd_function_apply`` with its forward
    and backward graphs. The pre-dispatch re-trace below runs its forward (under no_grad) and drops the backward,
    so every gradient through it would silently be zero; refuse it where a gradient could flow."""
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.autograd_function_apply):
        if any(isinstance(meta_val(a), torch.Tensor) and meta_val(a).requires_grad for a in node.all_input_nodes):
            raise CPCompileError(
                f"the model calls a custom torch.autograd.Function at {source_line(node)}: cp_passes re-traces the "
                f"graph to ATen ops, which keeps the Function's forward but not its backward, so every gradient "
                f"through it would be lost. Fix: write it with torch ops (autograd derives its backward), or make "
                f"it a custom op (torch.library.custom_op with register_autograd), which stays one op, and declare "
                f"it with cp_passes.positionwise(op) if it is position-wise; a Function that is position-wise may "
                f"instead be declared as it is: CPSpec(positionwise_functions=('package.module:Class',))")


def _refuse_float_lengths(gm: torch.fx.GraphModule, shape_env, sym) -> None:
    """A float computed from the length (``float(S)``, ``S ** -0.5``) is a value, never a size, and the re-trace
    to ATen bakes it in as the local length's (a pad's fill of ``float(S)`` became the constant 24.0). A row
    count that only divides (``total / float(x.shape[0])``, a mean written by hand) stays an argument of the
    division, which the planner makes global or refuses."""
    for node in gm.graph.nodes:
        val = node.meta.get("example_value")
        if isinstance(val, torch.SymFloat) and sym in shape_env.replace(val.node.expr).free_symbols \
                and not _only_divides(node):
            raise CPCompileError(
                f"the model computes a float from the sequence length at {source_line(node)}: under CP each rank's "
                f"length is 1/P of the global one, so the value would be the local length's. Fix: pass the global "
                f"length (or the float) in as an input, or derive it outside the compiled module")


_FLOAT_ARITHMETIC = {operator.add, operator.mul, torch.sym_float}


def _only_divides(node: torch.fx.Node) -> bool:
    """Every use of the float ``node``, through sums and products of such floats, is the divisor of a tensor."""
    for user in node.users:
        if user.target in (operator.truediv, torch.div, torch.true_divide, torch.Tensor.div) and len(user.args) == 2 \
                and user.args[1] is node and isinstance(user.args[0], torch.fx.Node) \
                and isinstance(user.args[0].meta.get("example_value"), torch.Tensor):
            continue
        if user.target in _FLOAT_ARITHMETIC and isinstance(user.meta.get("example_value"), torch.SymFloat) \
                and _only_divides(user):
            continue
        return False
    return True


def capture(gm: torch.fx.GraphModule, sharded: dict[int, tuple[str, int]], local_len: int, multiple: int = 1):
    """Re-trace dynamo's graph to pre-dispatch ATen (stack traces and module paths kept) after proving that
    every sharded input carries one symbolic sequence length, a multiple of ``multiple`` (the spec's
    ``pad_multiple``). Returns ``(aten_gm, fakes)``."""
    _refuse_custom_backwards(gm)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    fake_mode = torch._guards.detect_fake_mode([meta_val(n) for n in placeholders])
    shape_env = fake_mode.shape_env
    inputs = sharded_placeholders(gm, sharded)
    if not inputs:
        raise CPCompileError(
            "none of the sharded inputs reaches the compiled graph, so nothing in it depends on the sequence; "
            "check the spec's seq_inputs against the arguments the model reads"
        )
    sizes = []
    for node, (name, seq_dim) in inputs:
        size = _seq_size(node, seq_dim)
        if not isinstance(size, torch.SymInt) or shape_env.replace(size.node.expr).is_number:
            source = node.meta["grapharg"].source.name
            raise _specialized_error(name, local_len, _where_specialized(shape_env, f"{source}.size()[{seq_dim}]"))
        sizes.append(size)
    for size in sizes[1:]:
        torch._check(size == sizes[0])  # the wrapper checked the lengths are equal: one symbol for all of them
    # The wrapper checked that the length is a multiple: told so, the shape env simplifies sizes such as
    # s // (s // m). It does not derive s % 2 == 0 from s % 4 == 0, so every divisor is stated.
    for divisor in range(2, multiple + 1):
        if multiple % divisor == 0:
            torch._check(sizes[0] % divisor == 0)
    sym = shape_env.replace(sizes[0].node.expr)
    _refuse_float_lengths(gm, shape_env, sym)
    retracer = _Retracer(gm, shape_env, sym if sym.is_Symbol else None)
    with fx_traceback.preserve_node_meta(), schema_once():
        aten_gm = make_fx(retracer.run, pre_dispatch=True, tracing_mode="fake")(*[meta_val(n) for n in placeholders])
    _forget_region_graphs()  # the re-trace cached each region's graphs by name; AOTAutograd traces them afresh
    if shape_env.replace(sym).is_number:
        at = retracer.specialized_at
        where = source_line(at) if at is not None else "an unknown node"
        raise _specialized_error(inputs[0][1][0], local_len, where)
    aten_placeholders = list(aten_gm.graph.find_nodes(op="placeholder"))
    names = {node: name for node, (name, _) in inputs}
    for node, named in zip(aten_placeholders, placeholders):
        node._rename(named.name)  # l_doc_ids_, l_self_modules_embed_parameters_weight_ rather than arg9_1
        if named in names:
            node.meta[INPUT_NAME] = names[named]
    aten_gm.recompile()
    # make_fx converts the inputs into the backend's fake mode; later passes must use those values.
    return aten_gm, [meta_val(n) for n in aten_placeholders]



def capture_regions_inlined_where_written(gm: torch.fx.GraphModule, sharded: dict[int, tuple[str, int]],
                                          local_len: int, multiple: int = 1):
    """:func:`capture`; where it fails and a nested compile region writes one of its operands in place (which
    torch's ``invoke_subgraph`` cannot train through), those regions are inlined at their calls
    (:func:`~.regions.inline_writing_regions`) and the graph captured again. Only a failed capture pays for
    the search. Returns ``(aten_gm, fakes, lines)``, a line per region inlined."""
    try:
        return (*capture(gm, sharded, local_len, multiple), [])
    except Exception:
        lines = inline_writing_regions(gm)
        if not lines:
            raise
    _forget_region_graphs()  # the failed re-trace cached graphs of regions that no longer exist
    return (*capture(gm, sharded, local_len, multiple), lines)


def _forget_region_graphs() -> None:
    """Empty the tracing context's cache of region graphs (by region name), which a re-trace fills."""
    context = torch._guards.TracingContext.try_get()
    if context is not None:
        context.hop_dispatch_set_cache = type(context.hop_dispatch_set_cache)()


def install_output_hooks(model: torch.nn.Module) -> None:
    """transformers installs its output-recording hooks (``output_router_logits``, ``output_hidden_states``)
    on a model's first call that asks for outputs, under a lock dynamo cannot enter; installed beforehand (they
    record only while a call collects), the call traces as one graph."""
    import sys

    capturing = sys.modules.get("transformers.utils.output_capturing")
    if capturing is None:
        return
    for module in model.modules():
        if capturing._CAN_RECORD_REGISTRY.get(module):
            capturing.maybe_install_capturing_hooks(module)
