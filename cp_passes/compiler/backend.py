"""The torch.compile backend and the ``cp_compile`` wrapper around it.

capture (dynamo, sequence dim symbolic) -> re-trace to a pre-dispatch ATen graph (node meta kept)
-> the pipeline (:mod:`.pipeline`: analyse, match, plan, transports, verify) -> agreement between the
ranks -> lower (Inductor or aot_eager).
"""

from __future__ import annotations

import collections
import difflib
import functools
import inspect
import os
import sys
import time

import torch
import torch.fx

from ..data.batch import shard_batch
from ..data_parallel import check_wrappers
from ..errors import CPCompileError, compile_error, stage_error
from ..graph.checkpoint import inline_checkpoints
from ..graph.provenance import format_graph
from ..group import CPGroup, resolve_group
from ..eager_modules import install as install_eager_modules
from ..functions import install as install_functions
from ..kernels import install
from ..lifted import install as install_lifted
from ..spec import CPSpec, resolve_spec, shipped_spec_for
from ..report.dump import trace_record, write_dump
from ..report.explain import format_record
from ..report.memory import saved_for_backward
from ..transports import collective_ops
from .schedule import schedule_for_overlap
from .agreement import agree_before_running, alone, check_inputs, collective_fingerprint, describe_inputs
from .batch_layout import confirm_order, read_batch
from ..experts import install as install_experts
from .capture import capture_regions_inlined_where_written, install_output_hooks, tracing_config
from .interleave import interleaved_refusal
from .padding import pad_readers, padding_refusal
from .pipeline import CompileRecord, rewrite_graph
from .regions import mark_gradients, mark_regions, repeated_blocks, schema_once, stamp_regions
from .planner import Plan

BACKENDS = ("inductor", "aot_eager")


class CPBackend:
    """A dynamo backend bound to one ``CPModule``; each compiled graph adds a ``CompileRecord``.

    Whether it compiles or fails, every rank then agrees with the others (``agreement.agree_before_running``)
    before the new graph issues its first collective."""

    def __init__(self, owner: "CPModule"):
        self.owner = owner

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        owner = self.owner
        start = time.perf_counter()
        cp = owner.cp
        record = CompileRecord(cp.rank, cp.size, owner._local_len, owner.backend,
                               recompile_reasons=list(owner._guard_failures))
        stage = "capture"
        try:  # everything that can fail happens before the agreement: after it, the other ranks run the graph
            record.history.append(("captured (dynamo)", gm.print_readable(print_output=False)))
            regions = inline_checkpoints(gm)
            if regions:
                record.history.append((f"checkpointed regions inlined ({regions})",
                                       gm.print_readable(print_output=False)))
            aten_gm, fakes, inlined = capture_regions_inlined_where_written(gm, owner._sharded, owner._local_len,
                                                                            owner.spec.pad_multiple)
            for line in inlined:
                record.history.append((line, gm.print_readable(print_output=False)))
            stage = "rewrite"
            plan = rewrite_graph(aten_gm, fakes, owner.spec, cp, record)
            readers = [line for _, part in plan.parts() for line in pad_readers(part, owner.spec)]
            telling = plan.interleave_readers
            owner._refuse_padding(readers)
            owner._refuse_interleaved(telling)
            fingerprint = collective_fingerprint(aten_gm, collective_ops()) + [
                f"{region.name} ({len(region.calls)} calls): {line}" for region in plan.regions
                for line in collective_fingerprint(region.graph, collective_ops())]
            self._announce(record, plan, aten_gm)
            stage = "lowering"
            if owner.backend == "inductor" and stamp_regions(aten_gm):
                record.history.append(("regions stamped out at their calls (for Inductor)", format_graph(aten_gm)))
            mark_gradients(aten_gm, example_inputs)
            if owner.backend == "inductor" and owner.dynamic is None and not owner.compile_records:
                record.static = specialize_length(example_inputs)
            with schema_once():
                compiled = _lower(aten_gm, example_inputs, owner.backend, record)
            stage = "record"
            record.seconds = time.perf_counter() - start
            trace_record(record)
            if owner.dump_dir:
                write_dump(owner.dump_dir, record, len(owner.compile_records))
        except Exception as error:
            failure = stage_error(error, stage, owner.backend)
            owner._agreed = True
            agree_before_running(cp, failure, True, [], owner._guard_failures)
            raise failure from failure.internal
        owner._agreed = True
        agree_before_running(cp, None, True, fingerprint, owner._guard_failures)
        owner.compile_records.append(record)
        if owner.verbose and _first_rank():
            print(f"cp_passes: compiled in {record.seconds:.1f} s", file=sys.stderr, flush=True)

        @functools.wraps(compiled)
        def run(*args):
            owner._refuse_padding(readers)  # a cached graph: before the agreement, which reports it to every rank
            owner._refuse_interleaved(telling)
            if not owner._agreed:  # a cached graph: the ranks still agree that none of them compiled
                owner._agreed = True
                agree_before_running(cp, None, False, [])
            owner._entered = True
            return compiled(*args)

        return run

    def _announce(self, record: CompileRecord, plan: Plan, gm: torch.fx.GraphModule) -> None:
        owner, cp = self.owner, self.owner.cp
        if owner.explain_ranks is not None and (owner.explain_ranks == "all" or cp.rank in owner.explain_ranks):
            print(format_record(record), file=sys.stderr, flush=True)
        if owner.verbose and _first_rank():
            print(
                f"cp_passes: rank 0 of {cp.size}: {len(plan.rewrites)} rewrites planned; lowering "
                f"{sum(1 for _ in gm.graph.nodes)} nodes with {owner.backend} (first compile takes a while)...",
                file=sys.stderr,
                flush=True,
            )


def specialize_length(example_inputs) -> bool:
    """Make the sequence length a constant for lowering: the graph was planned and checked with it symbolic,
    and Inductor now generates kernels for this call's length alone (as ``torch.compile`` does on its first
    call; dynamo guards the length, so another length compiles once more, then symbolically for every length).
    Returns whether there was a symbol to fix."""
    from torch.fx.experimental.symbolic_shapes import guard_int

    fixed = False
    for value in example_inputs:
        sizes = (value,) if isinstance(value, torch.SymInt) else value.shape if isinstance(value, torch.Tensor) else ()
        for size in sizes:
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                guard_int(size)
                fixed = True
    return fixed


def _first_rank() -> bool:
    """Rank 0 of the whole job: one progress line however many CP groups (data-parallel replicas) compile."""
    return torch.distributed.get_rank() == 0


def _lower(gm: torch.fx.GraphModule, example_inputs, backend: str, record: CompileRecord):
    forwards = []

    def keep(kind):
        def capture(graph: torch.fx.GraphModule):
            name = kind if kind not in record.aot_graphs else f"{kind}_{len(record.aot_graphs)}"
            record.aot_graphs[name] = format_graph(graph)
            record.aot_ops[name] = collections.Counter(
                str(n.target) for n in graph.graph.nodes if n.op == "call_function")
            if kind == "forward":
                forwards.append(graph)
            else:
                record.saved.extend(saved_for_backward(graph, forwards[-1] if forwards else None))

        return capture

    if backend == "inductor":
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def inner_compile(graph, inputs, **kwargs):
            schedule_for_overlap(graph, collective_ops())
            keep("backward" if kwargs.get("is_backward") else "forward")(graph)
            compiled = compile_fx_inner(graph, inputs, **kwargs)
            code = getattr(compiled, "source_code", None)
            if code:
                record.output_code.append(code)
            return compiled

        return compile_fx(gm, example_inputs, inner_compile=inner_compile)

    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    def compiler(kind):
        def fn(graph, inputs):
            schedule_for_overlap(graph, collective_ops())
            keep(kind)(graph)
            return make_boxed_func(graph.forward)

        return fn

    # The partitioner Inductor and torch's own aot_eager use: saved tensors and recomputation match theirs.
    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                        partition_fn=min_cut_rematerialization_partition)(gm, example_inputs)


class CPModule(torch.nn.Module):
    """A model compiled for context parallelism. Call it with this rank's positions of every sequence input,
    as :func:`cp_passes.shard_batch` with the same spec lays them out (the spec's layout); it returns this
    rank's rows of every sequence output in the same local order (``ShardLayout.positions`` names them) and,
    for sums over the sequence such as a summed loss, this rank's share: add the ranks' values up for the
    total."""

    def __init__(self, model: torch.nn.Module, spec: CPSpec, cp: CPGroup, backend: str, dump_dir, verbose: bool,
                 explain_ranks=None, dynamic: bool | None = None):
        super().__init__()
        self.dynamic = dynamic
        self.explain_ranks = explain_ranks
        self.module = model
        self.spec = spec
        self.spec_origin = "given"
        """Where ``spec`` came from: "given", the default, or the shipped file ``model.config.model_type`` picked."""
        self.cp = cp
        self.backend = backend
        self.dump_dir = dump_dir
        self.verbose = verbose
        self.compile_records: list[CompileRecord] = []
        self._local_len = 0
        self._sharded: dict[int, tuple[str, int]] = {}  # id(tensor) -> (input name, sequence dim)
        self._agreed = self._entered = False
        self._guard_failures: list[str] = []
        self._padding = None  # how shard_batch padded this call's batch (the same on every rank), or None
        self._interleaved = False  # whether shard_batch interleaved this call's documents (balance="documents")
        self._signature = inspect.signature(model.forward)
        self.eager_modules = prepare_model(model, spec)
        # torch.compile(fullgraph=True, dynamic=False), plus the hook that reports which guard of an earlier
        # graph failed when a call recompiles.
        compiled = torch._dynamo.optimize(backend=CPBackend(self), nopython=True, dynamic=False,
                                          guard_fail_fn=self._guard_failed)(model)
        object.__setattr__(self, "_compiled", compiled)  # not a submodule: parameters stay listed once

    def shard_batch(self, batch, **options):
        """This rank's positions of ``batch`` as this module takes them: :func:`cp_passes.shard_batch` with this
        module's spec (the one cp_compile picked or was given) and CP group; ``options`` as it takes them
        (``pad_multiple``, ``mask_keys``, ``balance``...)."""
        return shard_batch(batch, self.cp.group, self, **options)

    def _guard_failed(self, failure) -> None:
        self._guard_failures.append(failure.reason)

    def _named_inputs(self, args, kwargs):
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError:
            return [(None, a) for a in args] + list(kwargs.items())
        named = []
        for name, value in bound.arguments.items():
            kind = self._signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                named.extend(value.items())
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                named.extend((None, v) for v in value)
            else:
                named.append((name, value))
        return named

    def _leaves(self, args, kwargs) -> list[tuple[str | None, torch.Tensor]]:
        leaves = []
        for name, value in self._named_inputs(args, kwargs):
            for path, leaf in torch.utils._pytree.tree_flatten_with_path(value)[0]:
                if isinstance(leaf, torch.Tensor):
                    key = path[-1].key if path and hasattr(path[-1], "key") else name
                    leaves.append((key if isinstance(key, str) else name, leaf))
        return leaves

    def _mark_sequence_inputs(self, leaves) -> int:
        """Mark the sequence dim of every sharded input dynamic (and record which tensors they are); return
        the local length. Inputs that look sharded but that the spec does not list are refused."""
        spec = self.spec
        found = spec.length_input(leaves)
        if found is None:
            listed = f" among seq_inputs={spec.seq_inputs}" if spec.seq_inputs is not None else ""
            names = [name for name, _ in leaves if name]
            hint = _did_you_mean(spec.seq_inputs or (), names)
            raise ValueError(f"cp_passes found no sequence input: no tensor argument has its sequence dim{listed} "
                             f"(the call passes {names}){hint}")
        seq_len, leading = spec.length_of(*found), spec.batch_dims(*found)
        if seq_len % spec.pad_multiple:
            raise ValueError(f"the local sequence length {seq_len} is not a multiple of spec {spec.name!r}'s "
                             f"pad_multiple={spec.pad_multiple} (the model groups the sequence into windows that "
                             f"must not straddle ranks); shard the batch with cp_passes.shard_batch(batch, mesh, "
                             f"spec), which pads to a multiple of P * pad_multiple")
        self._sharded = {}
        for name, t in leaves:
            dim, length = spec.dim_of(name, t), spec.length_of(name, t)
            if spec.seq_inputs is not None and name in spec.seq_inputs and length != seq_len:
                has = f"length {length} on dim {dim}" if length is not None else f"no dim {dim}"
                raise ValueError(f"sequence input {name!r} {tuple(t.shape)} has {has}, expected the local length "
                                 f"{seq_len} there")
            if spec.is_sharded(name, t, seq_len, leading):
                if seq_len < 2:
                    raise ValueError(
                        f"local sequence length {seq_len} is too short for cp_passes (need >= 2 tokens per rank); "
                        f"use fewer ranks or a longer sequence"
                    )
                self._sharded[id(t)] = (name or "<positional>", dim)
                # maybe_: Inductor may still specialize a kernel (conv backward does in 2.13) after the
                # passes have read the symbolic graph; that only costs a recompile for a new length.
                torch._dynamo.maybe_mark_dynamic(t, dim)
            elif name not in spec.replicated_inputs and length == seq_len:
                what = f"input {name!r}" if name else "a positional input"
                raise ValueError(
                    f"{what} {tuple(t.shape)} has the local sequence length {seq_len} on dim {dim} in this "
                    f"call, but spec {spec.name!r} does not list it in seq_inputs={spec.seq_inputs}"
                    f"{_did_you_mean(spec.seq_inputs, [name]) if name else ''}; add it to seq_inputs if each rank "
                    f"passes its slice (spec.replace(seq_inputs=spec.seq_inputs + ({name!r},))), or to "
                    f"replicated_inputs if every rank passes the same whole tensor (its size only equals the "
                    f"local length by chance)"
                )
        return seq_len

    def _refuse_padding(self, readers: list[str]) -> None:
        """Raise when shard_batch padded this call's batch and ``readers``, a graph's ops that read end padding
        (:func:`.padding.pad_readers`), would read it: the same verdict on every rank (the padding is the
        global batch's, the graph the one every rank compiled or reuses)."""
        if self._padding is not None and readers:
            multiple = self.cp.size * self.cp.layout.chunks * self.spec.pad_multiple
            raise padding_refusal(self._padding, readers, multiple)

    def _refuse_interleaved(self, readers: list[str]) -> None:
        """Raise when shard_batch interleaved this call's documents and the graph would tell (``readers``,
        :func:`.interleave.interleave_readers`): the same verdict on every rank."""
        if self._interleaved and readers:
            raise interleaved_refusal(readers, self.spec)

    @torch.compiler.disable  # inside an outer torch.compile, dynamo would trace the model without cp_passes
    def forward(self, *args, **kwargs):
        if not self.compile_records:
            check_wrappers(self, self.module, self.cp.group)
        leaves = self._leaves(args, kwargs)
        batch = read_batch(self.spec, self.cp, leaves, read_data=not alone(self.cp))
        # first: every rank then takes the same decisions
        check_inputs(self.cp, describe_inputs(leaves), batch.lines(), batch.refusal)
        confirm_order(self.cp, batch)
        seq_len = self._mark_sequence_inputs(leaves)
        self._padding, self._interleaved = batch.padded, batch.interleaved
        self._local_len = seq_len
        # A recompile anywhere checks every cache entry of the (shared) code and reports each entry's failed
        # guard to the hook of the module that compiled it: keep only what this call reports.
        self._guard_failures.clear()
        self._agreed = self._entered = False
        try:
            with tracing_config():
                out = self._compiled(*args, **kwargs)
        except Exception as error:
            if self._entered:
                raise  # a run-time error inside a compiled graph, not a compile failure
            failure = compile_error(error, self.module)
            if not self._agreed:  # failed before reaching the backend: the other ranks wait for its report
                self._agreed = True
                agree_before_running(self.cp, failure, False, [], self._guard_failures)
            raise failure from failure.internal  # a cp_passes failure keeps its traceback; dynamo's wrappers go
        if not self._entered:  # the same on every rank: nothing ran that could exchange anything
            raise CPCompileError(
                "the model ran without a compiled graph, so every rank computed on its own shard alone: dynamo ran "
                "it eagerly (torch.compiler.set_stance(\"force_eager\") or a stance that falls back to eager) or "
                "skipped the model's forward. Let dynamo compile the CP model"
            )
        return self._whole_parameters(out)

    def _whole_parameters(self, out):
        """A parameter the model returns as it is (dynamo hands it back from the module, not from a graph) is whole
        on every rank: like a whole output the graph computes, it passes back ``1 / P`` of its gradient."""
        leaves = [leaf for leaf in torch.utils._pytree.tree_leaves(out)
                  if isinstance(leaf, torch.nn.Parameter) and leaf.requires_grad]
        if not leaves:  # the usual call: the outputs untouched
            return out
        parameters = {id(p) for p in self.module.parameters()}

        def share(leaf):
            if isinstance(leaf, torch.Tensor) and id(leaf) in parameters and leaf.requires_grad:
                return torch.ops.cp_passes.whole_output(leaf, self.cp.size)
            return leaf

        return torch.utils._pytree.tree_map(share, out)


def prepare_model(model: torch.nn.Module, spec: CPSpec) -> dict:
    """What the spec declares, installed before the model is traced; returns the modules run eagerly."""
    install(spec.recurrences)  # the declared recurrent kernels, each called as one op from now on
    install_lifted(spec.lifted_forwards)  # and the forwards whose inline loop a copy lifts into one of them
    install_functions(spec.positionwise_functions)  # and the declared autograd.Functions
    eager = install_eager_modules(model, spec.eager_modules)  # and the modules run eagerly
    install_experts(model, spec.experts)  # experts without transformers' switch: its grouped_mm forward
    install_output_hooks(model)
    return eager


def _did_you_mean(names, candidates) -> str:
    close = [(n, c) for n in names for c in difflib.get_close_matches(n, [c for c in candidates if c and c != n], 1)]
    return "".join(f"; did you mean {c!r} for {n!r}?" for n, c in close)


def _explain_ranks(explain):
    if explain is None:
        value = os.environ.get("CP_PASSES_EXPLAIN", "").strip()
        if not value or value == "0":
            return None
        if value in ("1", "all"):
            return "all"
        try:
            return {int(r) for r in value.split(",")}
        except ValueError:
            raise ValueError(f"CP_PASSES_EXPLAIN must be 1, all, or comma-separated ranks, got {value!r}") from None
    if explain is True:
        return "all"
    if explain is False:
        return None
    return {int(r) for r in explain}


def cp_compile(model: torch.nn.Module, spec: CPSpec | str | None = None, *, mesh, backend: str = "inductor",
               dump_dir: str | os.PathLike | None = None, verbose: bool = True, explain=None,
               regions=False, dynamic: bool | None = None) -> CPModule:
    """Compile ``model`` for context parallelism over ``mesh`` (a 1-D DeviceMesh or a ProcessGroup).

    ``spec`` is a :class:`CPSpec`, the name of a spec in ``model_specs/``, or ``None``: the shipped spec for the
    model's ``config.model_type`` when there is one (``explain`` names it), else the defaults of a plain causal
    LM (``CPSpec()`` asks for those whatever the model). ``backend="aot_eager"`` runs the same rewritten graph
    without Inductor.
    ``dump_dir`` receives every graph and the rewrite table. ``explain`` prints the rewrite table to stderr
    when a graph compiles: ``True`` on every rank, or a collection of ranks; ``None`` reads the environment
    variable ``CP_PASSES_EXPLAIN`` (``1``/``all``, or ranks such as ``0,3``). ``regions=True`` compiles each
    repeated block (a class a ``ModuleList`` holds twice or more: transformer layers) once, as a nested compile
    region planned once for all its layers; a list of classes or class names marks those. Compilation happens on
    the first call.

    Planning always keeps the sequence length symbolic. ``dynamic`` says how Inductor lowers, as in
    ``torch.compile``: ``None`` lowers the first graph for its call's length (faster to compile and to run) and a
    call at another length compiles once more, for every length; ``True`` lowers for every length from the first
    call (one compile when lengths vary).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if dynamic not in (None, True):
        raise ValueError(f"dynamic must be None (the first length static, then symbolic) or True, got {dynamic!r}")
    config = getattr(model, "config", None)
    picked = shipped_spec_for(config) if spec is None else None
    origin = ("given" if spec is not None else "the default: no shipped spec serves this model" if picked is None
              else f"model_specs/{picked}.py, picked by model_type {config.model_type!r}")
    spec = resolve_spec(spec, config)
    spec.check_module_globs([name for name, _ in model.named_modules(remove_duplicate=False)])
    if regions:
        mark_regions(model, repeated_blocks(model) if regions is True else regions)
    compiled = CPModule(model, spec, resolve_group(mesh, spec), backend, dump_dir, verbose, _explain_ranks(explain),
                        dynamic)
    compiled.spec_origin = origin
    return compiled
