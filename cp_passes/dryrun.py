"""Plan a model for any world size without running it: fake tensors, a fake process group, no memory.

The model is built and exported under a FakeTensorMode (torch.export, non-strict, the sequence dim a
named Dim), then the same analysis, planning and transport passes as ``cp_compile`` run on the
exported ATen graph. The record holds the rewrite table and every graph, as a compiled one does.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from .analysis import meta_val
from .backend import CompileRecord, rewrite_graph
from .spec import CPSpec
from .transports import resolve_group


def dry_run(build_model: Callable[[], torch.nn.Module], inputs: dict[str, tuple[tuple[int, ...], torch.dtype]],
            spec: CPSpec | None = None, *, mesh) -> CompileRecord:
    """Rewrite ``build_model()`` for the CP group ``mesh`` as ``cp_compile`` would, with fake tensors only.

    ``inputs`` maps forward-argument names to this rank's local ``(shape, dtype)``.
    """
    spec = spec if spec is not None else CPSpec()
    cp = resolve_group(mesh)
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    with fake_mode:
        model = build_model()
        kwargs = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in inputs.items()}
    seq_len = next(t.shape[spec.seq_dim] for name, t in kwargs.items()
                   if t.dim() > spec.seq_dim and (spec.seq_inputs is None or name in spec.seq_inputs))
    seq = torch.export.Dim("seq", min=2)
    dynamic = {name: ({spec.seq_dim: seq} if spec.is_sharded(name, t, seq_len) else None) for name, t in kwargs.items()}
    exported = torch.export.export(model, (), kwargs, dynamic_shapes=dynamic, strict=False)
    gm = exported.graph_module
    record = CompileRecord(cp.rank, cp.size, seq_len, "dry run (fake tensors)")
    record.history.append(("exported (torch.export, fake tensors)", gm.print_readable(print_output=False)))
    fakes = [meta_val(n) for n in gm.graph.find_nodes(op="placeholder")]
    rewrite_graph(gm, fakes, spec, cp, record)
    return record


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
