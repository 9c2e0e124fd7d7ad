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
    ``mesh`` (a DeviceMesh of any dims, or a ProcessGroup). Count the labels the loss reads: shifted ones.
    Divide each micro-batch's summed loss by it (or pass it to a transformers model as
    ``num_items_in_batch``)."""
    from torch.distributed.device_mesh import DeviceMesh

    tensors = [labels] if isinstance(labels, torch.Tensor) else list(labels)
    if not tensors:
        raise ValueError("global_token_count needs this rank's labels of at least one micro-batch")
    count = sum((t != ignore_index).sum() for t in tensors).to(torch.int64)
    if isinstance(mesh, DeviceMesh):
        groups = [mesh.get_group(d) for d in range(mesh.ndim)]
    elif isinstance(mesh, dist.ProcessGroup):
        groups = [mesh]
    else:
        raise TypeError(f"mesh must be a DeviceMesh or a ProcessGroup, got {type(mesh).__name__}")
    for group in groups:  # a sum over each mesh dim in turn is the sum over the whole mesh
        dist.all_reduce(count, group=group)
    return count


def _sum_hook(group, bucket):
    return dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future().then(lambda f: f.value()[0])


def sum_gradients(wrapper: torch.nn.Module) -> torch.nn.Module:
    """Make a data-parallel ``wrapper`` (a module ``fully_shard`` was applied to, or a
    ``DistributedDataParallel``) sum gradients over its ranks instead of averaging them, for losses divided
    by :func:`global_token_count`. Returns ``wrapper``. FSDP2 adds each micro-batch's reduced gradient to
    the sharded one, so accumulation needs nothing more; DDP reduces the whole accumulated gradient at every
    backward, so run all but a step's last micro-batch under ``wrapper.no_sync()``, as with any DDP
    accumulation."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(wrapper, FSDPModule):
        wrapper.set_gradient_divide_factor(1.0)
        wrapper.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has neither AVG nor PREMUL_SUM
    elif isinstance(wrapper, DistributedDataParallel):
        wrapper.register_comm_hook(wrapper.process_group, _sum_hook)
    else:
        raise TypeError(f"sum_gradients takes a module fully_shard was applied to or a DistributedDataParallel, "
                        f"got {type(wrapper).__name__}")
    return wrapper


def check_wrappers(module: torch.nn.Module, model: torch.nn.Module, cp_group: dist.ProcessGroup) -> None:
    """Refuse data-parallel wrapping that would leave the CP ranks' gradients unsummed or break the graph:
    ``fully_shard`` on a mesh without this rank's CP peers, or on the model's own submodules."""
    from torch.distributed.fsdp import FSDPModule

    inner = [name for name, sub in model.named_modules() if isinstance(sub, FSDPModule)]
    if inner:
        raise ValueError(
            f"fully_shard was applied to modules inside the CP model ({', '.join(repr(n or '<root>') for n in inner[:3])}"
            f"{', ...' if len(inner) > 3 else ''}): its hooks run outside any graph, so the model would not compile "
            f"as one graph. Apply fully_shard to the module cp_compile returns instead"
        )
    if not isinstance(module, FSDPModule):
        return
    peers = set(dist.get_process_group_ranks(cp_group))
    for group in module._get_fsdp_state()._fsdp_param_groups:
        mesh = group.mesh_info.mesh
        ranks = set(mesh.mesh.flatten().tolist())
        if not peers <= ranks:
            raise ValueError(
                f"fully_shard's mesh {mesh.mesh_dim_names} (ranks {sorted(ranks)}) does not hold this rank's CP "
                f"peers {sorted(peers)}: each CP rank's gradient is its tokens' share and must be summed over CP, "
                f"which a data-parallel wrapper only does over its own ranks. Shard over the flattened mesh "
                f"(mesh[\"dp\", \"cp\"]._flatten()) or the 2-D mesh (HSDP), then cp_passes.sum_gradients(module)"
            )
