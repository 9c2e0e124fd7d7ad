"""Ranks agree before they enter a compiled graph's collectives, so that no rank is left waiting.

Two checks, both collective over the CP group and both reached by every rank:

- per call, before the graph runs: the names, shapes and dtypes of the tensor inputs (so the local
  lengths, batch sizes and dtypes of sharded inputs) are the same on every rank. One all-reduce of a
  digest; only on a mismatch are the descriptions gathered to say which rank differs and how.
- per compile, before the new graph's first collective: every rank compiled (a rank that failed
  reports its error to the others) and every rank planned the same ordered collectives (a fingerprint
  of each collective with its shapes and dtypes). A failure raises on every rank.
"""

from __future__ import annotations

import hashlib
import inspect

import torch
import torch.distributed as dist
import torch.fx

from .analysis import hint, meta_val
from .errors import CPCompileError, source_line
from .transports import CPGroup

_DIGEST_BYTES = 7  # fits a non-negative int64


def _device(cp: CPGroup) -> str:
    return "cuda" if dist.get_backend(cp.group) == "nccl" else "cpu"


def _alone(cp: CPGroup) -> bool:
    """No peers to agree with: one rank, or a fake process group (planning and structure tests)."""
    return cp.size == 1 or dist.get_backend(cp.group) == "fake"


def _gather(cp: CPGroup, obj) -> list:
    everyone = [None] * cp.size
    dist.all_gather_object(everyone, obj, group=cp.group)
    return everyone


def describe_inputs(leaves: list[tuple[str | None, object]]) -> list[str]:
    """One line per tensor input: name, shape and dtype."""
    return [f"{name or '<positional>'}: {tuple(t.shape)} {t.dtype}" for name, t in leaves
            if isinstance(t, torch.Tensor)]


def _first_difference(descriptions: list[list[str]]) -> str:
    base = descriptions[0]
    for rank, lines in enumerate(descriptions[1:], start=1):
        if lines == base:
            continue
        for i in range(max(len(lines), len(base))):
            mine = lines[i] if i < len(lines) else "(nothing)"
            theirs = base[i] if i < len(base) else "(nothing)"
            if mine != theirs:
                return f"rank {rank} has {mine}, rank 0 has {theirs}"
    return "the ranks disagree"


def check_inputs(cp: CPGroup, lines: list[str]) -> None:
    """Raise ValueError on every rank unless every rank passes inputs of the same names, shapes and dtypes."""
    if _alone(cp):
        return
    text = "\n".join(lines)
    digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=_DIGEST_BYTES).digest(), "little")
    both = torch.tensor([digest, -digest], dtype=torch.int64, device=_device(cp))
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=cp.group)
    if int(both[0]) == digest and -int(both[1]) == digest:
        return
    raise ValueError(
        f"the CP ranks were called with different inputs ({_first_difference(_gather(cp, lines))}); every rank "
        f"must pass its shard of the same batch, with equal local lengths, batch sizes and dtypes: shard with "
        f"cp_passes.shard_batch, which pads to equal shards"
    )


def collective_fingerprint(gm: torch.fx.GraphModule, collectives: set) -> list[str]:
    """The ordered collectives of a rewritten graph, each with the shapes and dtypes it moves (rank-specific
    arguments left out: every rank must issue these, in this order)."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in collectives:
            continue
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs).arguments
        parts = []
        for name, value in bound.items():
            if name == "rank":
                continue
            val = meta_val(value)
            if isinstance(val, torch.Tensor):  # concrete sizes: a rank may have specialized a symbolic one
                parts.append(f"{name}={[hint(s) for s in val.shape]} {val.dtype}")
            elif not isinstance(value, torch.fx.Node):
                parts.append(f"{name}={value!r}")
        out.append(f"{node.target.__name__}({', '.join(parts)}) at {source_line(node, code=False)}")
    return out


def agree_on_compile(cp: CPGroup, error: BaseException | None, fingerprint: list[str]) -> None:
    """Every rank reports whether it compiled and which collectives it will issue; raise on every rank if one
    failed or if the schedules differ."""
    if _alone(cp):
        return
    report = (f"{type(error).__name__}: {error}" if error is not None else None, fingerprint)
    everyone = _gather(cp, report)
    failed = [(rank, err) for rank, (err, _) in enumerate(everyone) if err is not None]
    if failed:
        if error is not None:
            return  # this rank raises its own error
        rank, err = failed[0]
        others = f" (and ranks {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
        raise CPCompileError(f"rank {rank}{others} failed to compile, so no rank runs this graph. Rank {rank}'s "
                             f"error:\n{err}")
    schedules = [fp for _, fp in everyone]
    if all(fp == schedules[0] for fp in schedules):
        return
    rank = next(r for r, fp in enumerate(schedules) if fp != schedules[0])
    mine, base = schedules[rank], schedules[0]
    i = next(i for i in range(max(len(mine), len(base))) if i >= len(mine) or i >= len(base) or mine[i] != base[i])
    raise CPCompileError(
        f"the CP ranks planned different collective schedules, which would deadlock or exchange the wrong data: "
        f"collective #{i + 1} is {mine[i] if i < len(mine) else '(none)'} on rank {rank} but "
        f"{base[i] if i < len(base) else '(none)'} on rank 0. Every rank must compile the same model with the "
        f"same spec on inputs of the same shapes; a model whose code branches on the rank cannot be sharded"
    )
