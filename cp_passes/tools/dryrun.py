"""Plan a model for any world size without running it: fake tensors, a fake process group, no memory.

The model is built and exported under a FakeTensorMode (torch.export, non-strict, the sequence dim a
named Dim), then the same analysis, planning and transport passes as ``cp_compile`` run on the
exported ATen graph. The record holds the rewrite table and every graph, as a compiled one does.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ..graph.analysis import INPUT_NAME
from ..compiler.pipeline import CompileRecord, rewrite_graph
from ..compiler.planner import plan_graph
from ..graph.analysis import meta_val, numel_hint, sequence_symbol
from ..group import resolve_group
from ..kernels import install
from ..spec import CPSpec


def _export(build_model, inputs, spec: CPSpec):
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    with fake_mode:
        model = build_model()
        kwargs = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in inputs.items()}
    found = spec.length_input(list(kwargs.items()))
    if found is None:
        raise ValueError(f"no input has a sequence dim that spec {spec.name!r} may shard: {list(kwargs)}")
    seq_len, leading = spec.length_of(*found), spec.batch_dims(*found)
    seq = torch.export.Dim("seq", min=2)
    dynamic = {name: ({spec.dim_of(name, t): seq} if spec.is_sharded(name, t, seq_len, leading) else None)
               for name, t in kwargs.items()}
    exported = torch.export.export(model, (), kwargs, dynamic_shapes=dynamic, strict=False)
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return exported.graph_module, seq_len, parameter_bytes


def dry_run(build_model: Callable[[], torch.nn.Module], inputs: dict[str, tuple[tuple[int, ...], torch.dtype]],
            spec: CPSpec | None = None, *, mesh, plan_ranks: Iterable[int] = ()) -> DryRun:
    """Rewrite ``build_model()`` for the CP group ``mesh`` as ``cp_compile`` would, with fake tensors only.

    ``inputs`` maps forward-argument names to this rank's local ``(shape, dtype)``. The rewrite (every graph,
    the table, an activation estimate) is for ``mesh``'s rank; ``plan_ranks`` are only planned, for their
    byte counts.
    """
    spec = spec if spec is not None else CPSpec()
    cp = resolve_group(mesh)
    install(spec.recurrences)
    gm, seq_len, parameter_bytes = _export(build_model, inputs, spec)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    (sym,) = sequence_symbol(placeholders) or (None,)
    for node in placeholders:
        if node.name in inputs:  # export names a forward argument's placeholder after it
            node.meta[INPUT_NAME] = node.name
    per_rank = {}
    if sym is not None:
        for rank in plan_ranks:
            per_rank[rank] = plan_graph(gm, sym, spec, dataclasses.replace(cp, rank=rank)).records
    record = CompileRecord(cp.rank, cp.size, seq_len, "dry run (fake tensors)")
    record.history.append(("exported (torch.export, fake tensors)", gm.print_readable(print_output=False)))
    rewrite_graph(gm, [meta_val(n) for n in placeholders], spec, cp, record)
    return DryRun(record, per_rank, activation_bytes(gm), parameter_bytes)


_VIEWS = {"view", "_unsafe_view", "transpose", "permute", "expand", "unsqueeze", "squeeze", "t", "alias", "detach",
          "slice", "select", "narrow", "split", "split_with_sizes", "chunk", "unbind", "as_strided", "movedim"}


def activation_bytes(gm: torch.fx.GraphModule) -> int:
    """Bytes of every tensor the forward graph materializes (views excluded): an upper estimate of the
    activations autograd keeps for the backward at this rank's local length."""
    total = 0
    for node in gm.graph.nodes:
        val = meta_val(node)
        packet = getattr(getattr(node.target, "overloadpacket", None), "__name__", "")
        if node.op == "call_function" and isinstance(val, torch.Tensor) and packet not in _VIEWS:
            total += numel_hint(node) * val.element_size()
    return total


@dataclass
class DryRun:
    record: CompileRecord
    per_rank: dict[int, list]
    activation_bytes: int
    parameter_bytes: int


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
