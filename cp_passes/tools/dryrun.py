"""Plan a model for any world size without running it: fake tensors, a fake process group, no memory.

The model is built and exported under a FakeTensorMode (torch.export, non-strict, the sequence dim a
named Dim), then the same analysis, planning and transport passes as ``cp_compile`` run on the
exported ATen graph. The record holds the rewrite table and every graph, as a compiled one does. With
``memory=True`` AOTAutograd then partitions the rewritten graph and the single-device one (min-cut, as
``cp_compile`` lowers) on the same fake inputs, for :class:`~cp_passes.report.memory.MemoryEstimate`; in the
single-device one, a stack of identical blocks is partitioned as three and counted as all of them
(:mod:`cp_passes.report.repeats`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ..graph.analysis import INPUT_NAME
from ..compiler.backend import prepare_model
from ..compiler.capture import capture_regions_inlined_where_written, tracing_config
from ..compiler.pipeline import CompileRecord, plan_records, prepare_graph, rewrite_graph
from ..compiler.regions import mark_gradients, mark_regions, repeated_blocks, schema_once
from ..graph.analysis import meta_val, sequence_symbol
from ..graph.provenance import format_graph
from ..group import resolve_group
from ..kernels import install
from ..report.overlap import Overlap, overlap
from ..report.memory import MemoryEstimate, collective_output, largest, quadratic, saved_for_backward
from ..report.repeats import count_elided, elide_repeats
from ..compiler.schedule import schedule_for_overlap
from ..transports import collective_ops
from ..spec import CPSpec


def _inputs(inputs, model: torch.nn.Module) -> dict:
    """``inputs``, or what ``inputs(model)`` says the built model takes."""
    return inputs(model) if callable(inputs) else inputs


def _export(build_model, inputs, spec: CPSpec):
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    model = _fake_model(build_model, fake_mode)
    with fake_mode:
        kwargs = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in _inputs(inputs, model).items()}
    found = spec.length_input(list(kwargs.items()))
    if found is None:
        raise ValueError(f"no input has a sequence dim that spec {spec.name!r} may shard: {list(kwargs)}")
    seq_len, leading = spec.length_of(*found), spec.batch_dims(*found)

    def export(seq):
        dynamic = {name: ({spec.dim_of(name, t): seq} if spec.is_sharded(name, t, seq_len, leading) else None)
                   for name, t in kwargs.items()}
        return torch.export.export(model, (), kwargs, dynamic_shapes=dynamic, strict=False)

    try:
        exported = export(torch.export.Dim("seq", min=2))
    except torch._dynamo.exc.UserError as error:
        if error.error_type is not torch._dynamo.exc.UserErrorType.CONSTRAINT_VIOLATION:
            raise
        # The model constrains its length (DeepSeek V4's compressor: a multiple of 128, at least 256): any
        # length it accepts, still a symbol.
        exported = export(torch.export.Dim.DYNAMIC)
        if len(sequence_symbol(list(exported.graph_module.graph.find_nodes(op="placeholder")))) > 1:
            sharded = [name for name, t in kwargs.items() if spec.is_sharded(name, t, seq_len, leading)]
            raise ValueError(
                f"torch.export cannot give the sharded inputs {sharded} one symbolic length: the model constrains "
                f"it ({str(error).strip().splitlines()[0]}), and with a length of its own each they take different "
                f"ones. Plan it as cp_compile captures it (dynamo, which ties the lengths together): explain "
                f"without --no-regions, dry_run(..., regions=True)") from error
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return exported.graph_module, seq_len, parameter_bytes, list(kwargs)


class _Captured(Exception):
    """Raised by the dry run's dynamo backend once it holds the graph: nothing is compiled or run."""


def _fake_model(build_model, fake_mode: FakeTensorMode) -> torch.nn.Module:
    """``build_model()`` with fake CPU parameters and buffers: built on the meta device (no memory, no
    initialisation; a model that casts its own submodules, ``norm.to(torch.float32)``, cannot be built under a
    FakeTensorMode), then each tensor made a fake one of its shape and dtype."""
    with torch.device("meta"):
        model = build_model()
    made: dict[int, torch.Tensor] = {}  # a tied weight stays one tensor
    with fake_mode:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, value in table.items():
                    if value is not None and id(value) not in made:
                        fake = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype)
                        made[id(value)] = torch.nn.Parameter(fake, value.requires_grad) \
                            if isinstance(value, torch.nn.Parameter) else fake
                    if value is not None:
                        table[name] = made[id(value)]
    return model


def _capture(build_model, inputs, spec: CPSpec, regions):
    """The model as ``cp_compile`` captures it (dynamo, then the pre-dispatch ATen re-trace), on fake parameters and
    inputs; with ``regions`` (True, or classes) its repeated blocks are nested compile regions."""
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    model = _fake_model(build_model, fake_mode)
    with fake_mode:
        kwargs = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in _inputs(inputs, model).items()}
    prepare_model(model, spec)
    if regions:
        mark_regions(model, repeated_blocks(model) if regions is True else regions)
    found = spec.length_input(list(kwargs.items()))
    if found is None:
        raise ValueError(f"no input has a sequence dim that spec {spec.name!r} may shard: {list(kwargs)}")
    seq_len, leading = spec.length_of(*found), spec.batch_dims(*found)
    sharded = {}
    for name, t in kwargs.items():
        if spec.is_sharded(name, t, seq_len, leading):
            sharded[id(t)] = (name, spec.dim_of(name, t))
            torch._dynamo.mark_dynamic(t, spec.dim_of(name, t))
    held = {}

    def backend(gm, example_inputs):
        held["graph"], fakes, held["inlined"] = capture_regions_inlined_where_written(gm, sharded, seq_len,
                                                                                      spec.pad_multiple)
        for fake, example in zip(fakes, example_inputs):  # the re-trace's fakes lose it; the partition needs it
            if isinstance(example, torch.Tensor) and example.requires_grad:
                fake.requires_grad_(True)
        raise _Captured

    try:
        with tracing_config():
            torch._dynamo.optimize(backend, nopython=True, dynamic=False)(model)(**kwargs)
    except torch._dynamo.exc.BackendCompilerFailed as failed:
        if not isinstance(failed.inner_exception, _Captured):
            raise failed.inner_exception from None
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return held["graph"], seq_len, parameter_bytes, list(kwargs), held["inlined"]


def _heap_frozen(run):
    """``run`` with the objects alive before it left out of the garbage collector's scans (``gc.freeze``): a full
    collection otherwise walks every object torch, transformers and the model hold. The 32-layer Llama of
    ``benchmarks/compile_time.py`` spent 1.6 of its 13.4 CPU-s collecting, 0.6 frozen. Objects the run creates are
    collected as usual. Inside a caller that froze the heap itself, nothing changes."""

    @functools.wraps(run)
    def frozen(*args, **kwargs):
        if gc.get_freeze_count():
            return run(*args, **kwargs)
        gc.freeze()
        try:
            return run(*args, **kwargs)
        finally:
            gc.unfreeze()

    return frozen


@_heap_frozen
def dry_run(build_model: Callable[[], torch.nn.Module], inputs: dict[str, tuple[tuple[int, ...], torch.dtype]],
            spec: CPSpec | None = None, *, mesh, plan_ranks: Iterable[int] = (), memory: bool = False,
            regions=None) -> DryRun:
    """Rewrite ``build_model()`` for the CP group ``mesh`` as ``cp_compile`` would, with fake tensors only.

    ``inputs`` maps forward-argument names to this rank's local ``(shape, dtype)`` (or is a function of the built
    model that returns them). The rewrite (every graph,
    the table) is for ``mesh``'s rank; ``plan_ranks`` are only planned, for their
    byte counts. ``memory`` adds the estimate from AOTAutograd's partitions (tens of seconds for a large
    model). ``regions`` (True, or block classes) captures the model as ``cp_compile(regions=...)`` does, through
    dynamo, each repeated block planned once; without it the model is exported (``torch.export``).
    """
    spec = spec if spec is not None else CPSpec()
    cp = resolve_group(mesh, spec)
    install(spec.recurrences)
    if regions:
        gm, seq_len, parameter_bytes, names, inlined = _capture(build_model, inputs, spec, regions)
    else:
        (gm, seq_len, parameter_bytes, names), inlined = _export(build_model, inputs, spec), []
    # The single-device graph for the memory estimate: a copy of the capture, not a second one (dynamo traces
    # every layer's call again: half of a 45-layer model's dry run).
    single_gm = copy.deepcopy(gm) if memory and regions else None
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    (sym,) = sequence_symbol(placeholders) or (None,)
    for node in placeholders:
        if not regions and node.name in names:  # export names a forward argument's placeholder after it
            node.meta[INPUT_NAME] = node.name
    record = CompileRecord(cp.rank, cp.size, seq_len, "dry run (fake tensors)")
    record.history.append((f"aten (pre-dispatch), {'captured by dynamo' if regions else 'exported'} on fake tensors"
                           + "".join(f"; {line}" for line in inlined), gm.print_readable(print_output=False)))
    per_rank = {}
    if sym is not None:
        prepare_graph(gm, sym, spec, record.history)
        for rank in plan_ranks:
            per_rank[rank] = plan_records(gm, sym, spec, dataclasses.replace(cp, rank=rank))
    fakes = [meta_val(n) for n in placeholders]
    rewrite_graph(gm, fakes, spec, cp, record, record_input=False)
    estimate = overlapped = None
    forward = backward = None
    if memory and sym is not None:
        mark_gradients(gm, fakes)
        with schema_once():
            forward, backward = partition(gm, fakes)
        record.aot_graphs.update(forward=format_graph(forward), backward=format_graph(backward))
        single_gm = single_gm if single_gm is not None else _export(build_model, inputs, spec)[0]
        single_fakes = [meta_val(n) for n in single_gm.graph.find_nodes(op="placeholder")]
        elided = elide_repeats(single_gm)  # a stack of one block partitioned as three, counted as all of them
        mark_gradients(single_gm, single_fakes)
        with schema_once():
            single_forward, single_backward = partition(single_gm, single_fakes)
        single_sym = _symbol(single_gm)
        whole = (single_sym, cp.layout.global_len(seq_len))
        estimate = MemoryEstimate(
            cp.size, saved_for_backward(backward, forward),
            count_elided(saved_for_backward(single_backward, single_forward, whole), single_forward, elided),
            largest([forward, backward], collective_output(collective_ops())),
            largest([forward], quadratic(sym)),
            largest([single_forward], quadratic(single_sym), whole),
            parameter_bytes)
        record.saved = estimate.saved
        overlapped = overlap([forward, backward], collective_ops())
    return DryRun(record, per_rank, parameter_bytes, estimate, gm, fakes, overlapped, forward, backward)


def partition(gm: torch.fx.GraphModule, fakes: list) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """AOTAutograd's forward and backward graphs of ``gm`` on its fake inputs, partitioned by min-cut as
    ``cp_compile`` lowers (every floating-point output that needs a gradient gets one)."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs = {}

    def keep(kind):
        def compiler(graph, _):
            graphs[kind] = graph
            return make_boxed_func(graph.forward)
        return compiler

    fake_mode = torch._guards.detect_fake_mode(fakes)
    # A tracing context, as under dynamo: it caches each region's traced graphs for all its calls. The backward
    # is partitioned with the forward, not at a first backward run (which would run both graphs on fakes).
    with fake_mode, torch._guards.tracing(torch._guards.TracingContext(fake_mode)), \
            torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
        aot_module_simplified(gm, fakes, fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                              partition_fn=min_cut_rematerialization_partition)
    for graph in graphs.values():  # as cp_compile orders them before lowering
        schedule_for_overlap(graph, collective_ops())
    return graphs["forward"], graphs["backward"]


def _symbol(gm: torch.fx.GraphModule):
    (sym,) = sequence_symbol(list(gm.graph.find_nodes(op="placeholder")))
    return sym




@dataclass
class DryRun:
    record: CompileRecord
    per_rank: dict[int, list]
    parameter_bytes: int
    memory: MemoryEstimate | None = None
    graph: torch.fx.GraphModule | None = None
    """The rewritten graph (pre-dispatch ATen), which runs on ``fakes``."""
    fakes: list | None = None
    overlap: Overlap | None = None
    """How much of the collectives' traffic the AOT graphs can hide behind compute (with ``memory``)."""
    forward: torch.fx.GraphModule | None = None
    """AOTAutograd's forward graph of the rewritten one, ordered for overlap as ``cp_compile`` lowers it (with
    ``memory``); ``backward`` likewise."""
    backward: torch.fx.GraphModule | None = None


@contextlib.contextmanager
def fake_group(world_size: int, rank: int):
    """A fake process group of any size as the default group, for planning without processes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_group needs a process without a default process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
