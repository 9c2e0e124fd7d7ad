"""The context-parallel process group as the passes and the eager helpers see it."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from .layout import CONTIGUOUS, Layout, resolve_layout


@dataclass(frozen=True)
class CPGroup:
    """The CP group: its name (what functional collectives address), this rank, the size and the layout kind
    (:func:`cp_passes.layout.resolve_layout` from the spec)."""

    group: dist.ProcessGroup
    name: str
    rank: int
    size: int
    kind: str = CONTIGUOUS

    @property
    def layout(self) -> Layout:
        return Layout(self.size, self.kind)


def resolve_group(mesh, spec=None) -> CPGroup:
    """Accept a 1-D ``DeviceMesh`` or a ``ProcessGroup`` for the CP dimension; the layout is the one ``spec``
    resolves to (contiguous without a spec)."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != 1:
            raise ValueError(
                f"cp_passes needs the 1-D CP dimension of a mesh, got a {mesh.ndim}-D mesh "
                f"{mesh.mesh_dim_names}; pass mesh['cp'] (or your CP dim's name)"
            )
        group = mesh.get_group()
    elif isinstance(mesh, dist.ProcessGroup):
        group = mesh
    else:
        raise TypeError(f"mesh must be a 1-D DeviceMesh or a ProcessGroup, got {type(mesh).__name__}")
    size = dist.get_world_size(group)
    kind = CONTIGUOUS if spec is None else resolve_layout(spec, size)[0].kind
    return CPGroup(group, group.group_name, dist.get_rank(group), size, kind)
