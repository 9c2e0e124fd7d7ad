"""CP inside data parallelism: FSDP2 or DDP over a mesh that includes the CP ranks, losses normalised by the
step's global token count.

Each CP rank's backward gives the gradient of its own tokens' share of the loss, so the ranks' gradients
must be *summed* over CP; data parallelism sums over replicas too once the loss is divided by the token
count of the whole step (every micro-batch, every rank), which also makes micro-batches of different
lengths weigh as they do in one big batch. The wrapper does the sum if it reduces over the CP ranks as well:

- FSDP2 over the flattened ``(dp, cp)`` mesh (torchtitan's arrangement: CP ranks shard parameters too), or
  HSDP over the 2-D mesh (replicated over dp, sharded over cp);
- DDP over the flattened mesh's group.

:func:`sum_gradients` makes it sum instead of average, and :func:`global_token_count` gives the divisor.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist


def global_token_count(labels: torch.Tensor | Iterable[torch.Tensor], mesh, ignore_index: int = -100) -> torch.Tensor:
    """The number of loss targets in the whole step: this rank's local ``labels`` (one tensor per micro-batch,
    as ``shard_batch`` left them, padding set to ``ignore_index``) counted and summed over every rank of
    ``mesh`` (a DeviceMesh whose dims are all data or context parallel, or a ProcessGroup). Count the labels
    the loss reads: shifted ones; ``ignore_index`` is the spec's (``shard_batch`` pads labels with it).
    Divide each micro-batch's summed loss by it (or pass it to a transformers model as
    ``num_items_in_batch``)."""
    tensors = [labels] if isinstance(labels, torch.Tensor) else list(labels)
    if not tensors:
        raise ValueError("global_token_count needs this rank's labels of at least one micro-batch")
    return _sum_over(sum((t != ignore_index).sum() for t in tensors).to(torch.int64), mesh)


def _sum_over(value: torch.Tensor, mesh) -> torch.Tensor:
    """``value`` (modified) summed over every rank of ``mesh``, a DeviceMesh or a ProcessGroup."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh, DeviceMesh):
        groups = [mesh.get_group(d) for d in range(mesh.ndim)]
    elif isinstance(mesh, dist.ProcessGroup):
        groups = [mesh]
    else:
        raise TypeError(f"mesh must be a DeviceMesh or a ProcessGroup, got {type(mesh).__name__}")
    for group in groups:  # a sum over each mesh dim in turn is the sum over the whole mesh
        dist.all_reduce(value, group=group)
    return value


def global_loss(loss: torch.Tensor, mesh) -> torch.Tensor:
    """The value to log for a loss each CP rank holds its share of (a summed loss, or ``out.loss`` of a
    transformers model called with ``labels=``): the ranks' shares added up over ``mesh`` (a DeviceMesh or a
    ProcessGroup), detached. It is the single-device value, on every rank; ``loss.item()`` alone shows about 1/P
    of it. A loss every rank holds whole (a classifier's over pooled rows) is logged as it is, not through this."""
    return _sum_over(loss.detach().clone(), mesh)


def _sum_hook(group, bucket):
    return dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future().then(lambda f: f.value()[0])


def _cp_groups(module: torch.nn.Module) -> list[dist.ProcessGroup]:
    """The CP groups of the ``cp_compile``d modules in ``module`` (itself included)."""
    from .group import CPGroup

    return [m.cp.group for m in module.modules() if isinstance(getattr(m, "cp", None), CPGroup)]


def _require_peers(ranks: set[int], what: str, cp_groups: list[dist.ProcessGroup]) -> None:
    for group in cp_groups:
        peers = set(dist.get_process_group_ranks(group))
        if not peers <= ranks:
            raise ValueError(
                f"{what} (ranks {sorted(ranks)}) does not hold this rank's CP peers {sorted(peers)}: each CP rank's "
                f"gradient is its tokens' share and must be summed over CP, which a data-parallel wrapper only does "
                f"over its own ranks. Shard over the flattened mesh (mesh[\"dp\", \"cp\"]._flatten()) or the 2-D "
                f"mesh (HSDP), or run DDP over the flattened mesh's group; then cp_passes.sum_gradients(wrapper)"
            )


def _fsdp_groups(module):
    return module._get_fsdp_state()._fsdp_param_groups


def sum_gradients(wrapper: torch.nn.Module) -> torch.nn.Module:
    """Make a data-parallel ``wrapper`` (a module ``fully_shard`` was applied to, or a
    ``DistributedDataParallel``) sum gradients over its ranks instead of averaging them, for losses divided
    by :func:`global_token_count`. Returns ``wrapper``. FSDP2 adds each micro-batch's reduced gradient to
    the sharded one, so accumulation needs nothing more; DDP reduces the whole accumulated gradient at every
    backward, so run all but a step's last micro-batch under ``wrapper.no_sync()``, as with any DDP
    accumulation. A wrapper whose ranks do not include the CP peers of a ``cp_compile``d module inside it is
    refused: it would never sum over CP."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    cp_groups = _cp_groups(wrapper)
    if isinstance(wrapper, FSDPModule):
        for group in _fsdp_groups(wrapper):
            mesh = group.mesh_info.mesh
            _require_peers(set(mesh.mesh.flatten().tolist()), f"fully_shard's mesh {mesh.mesh_dim_names}", cp_groups)
        wrapper.set_gradient_divide_factor(1.0)
        wrapper.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has neither AVG nor PREMUL_SUM
    elif isinstance(wrapper, DistributedDataParallel):
        group = wrapper.process_group
        _require_peers(set(dist.get_process_group_ranks(group)), "DDP's process group", cp_groups)
        wrapper.register_comm_hook(group, _sum_hook)
    else:
        raise TypeError(f"sum_gradients takes a module fully_shard was applied to or a DistributedDataParallel, "
                        f"got {type(wrapper).__name__}")
    return wrapper


def check_wrappers(module: torch.nn.Module, model: torch.nn.Module, cp_group: dist.ProcessGroup) -> None:
    """Refuse data-parallel wrapping of a ``cp_compile``d ``module`` that would leave the CP ranks' gradients
    wrong or break the graph: ``fully_shard`` on the model's own submodules, on a mesh without this rank's CP
    peers, or left averaging (each CP rank's gradient is a share to add, not an estimate to average)."""
    from torch.distributed.fsdp import FSDPModule

    inner = [name for name, sub in model.named_modules() if isinstance(sub, FSDPModule)]
    if inner:
        raise ValueError(
            f"fully_shard was applied to modules inside the CP model "
            f"({', '.join(repr(n or '<root>') for n in inner[:3])}"
            f"{', ...' if len(inner) > 3 else ''}): its hooks run outside any graph, so the model would not compile "
            f"as one graph. Apply fully_shard to the module cp_compile returns instead"
        )
    if not isinstance(module, FSDPModule):
        return
    for group in _fsdp_groups(module):
        mesh = group.mesh_info.mesh
        _require_peers(set(mesh.mesh.flatten().tolist()), f"fully_shard's mesh {mesh.mesh_dim_names}", [cp_group])
        if group.gradient_divide_factor is None:
            raise ValueError(
                "fully_shard averages gradients over its ranks, but each CP rank's gradient is its tokens' share of "
                "the loss, to be summed: call cp_passes.sum_gradients(module) and divide each summed loss by "
                "cp_passes.global_token_count(...) (or set_gradient_divide_factor(dp size) for losses averaged per "
                "data-parallel replica)"
            )
