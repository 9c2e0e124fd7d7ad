"""Ranks agree before they enter a compiled graph's collectives, so that no rank is left waiting.

Two checks, both collective over the CP group and both reached by every rank:

- per call, before the graph runs: the names, shapes and dtypes of the tensor inputs (so the local
  lengths, batch sizes and dtypes of sharded inputs) are the same on every rank, and no rank refuses its
  batch (:mod:`.batch_layout`). One all-reduce of a digest; only on a mismatch are the descriptions
  gathered to say which rank differs and how.
- per call, just before the graph's first collective: every rank compiled, or every rank reuses a
  graph (a rank whose cached graph still holds while another compiles would run its collectives
  alone), no rank failed (a rank that failed reports its error to the others), and the ranks that
  compiled planned the same ordered collectives (a fingerprint of each collective with its shapes and
  dtypes). One all-reduce of five integers; a problem raises on every rank.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
import torch.fx

from ..errors import CPCompileError, counted, source_line
from ..graph.analysis import bind_args, hint, meta_val
from ..group import CPGroup

_DIGEST_BYTES = 7  # fits a non-negative int64


def collective_device(cp: CPGroup) -> str:
    """Where the group's collectives take their tensors: the GPU for NCCL, else the CPU."""
    return "cuda" if dist.get_backend(cp.group) == "nccl" else "cpu"


def alone(cp: CPGroup) -> bool:
    """No peers to agree with: one rank, or a fake process group (planning and structure tests)."""
    return cp.size == 1 or dist.get_backend(cp.group) == "fake"


def _gather(cp: CPGroup, obj) -> list:
    everyone = [None] * cp.size
    dist.all_gather_object(everyone, obj, group=cp.group)
    return everyone


def describe_inputs(leaves: list[tuple[str | None, object]]) -> list[str]:
    """One line per tensor input (name, shape, dtype, whether it requires grad), and the grad mode: what the
    compiled graph's guards read that the ranks must agree on."""
    lines = [f"{name or '<positional>'}: {tuple(t.shape)} {t.dtype}{' requires_grad' if t.requires_grad else ''}"
             for name, t in leaves if isinstance(t, torch.Tensor)]
    return lines + [f"grad mode: {'on' if torch.is_grad_enabled() else 'off'}"]


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


def check_inputs(cp: CPGroup, lines: list[str], batch_lines: list[str] = (), refusal: str | None = None) -> None:
    """Raise ValueError on every rank unless every rank passes inputs of the same names, shapes and dtypes
    (``lines``), agrees on how its batch was cut (``batch_lines``) and no rank refuses its batch (``refusal``:
    why this rank does, read locally; it rides on the same all-reduce, so that a rank whose batch is fine
    raises with the rank whose batch is not). Inputs that differ are reported first."""
    if alone(cp):
        if refusal is not None:
            raise ValueError(refusal)
        return
    digest = _digest("\n".join([*lines, *batch_lines]))
    both = torch.tensor([digest, -digest], dtype=torch.int64, device=collective_device(cp))
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=cp.group)
    if int(both[0]) == digest and -int(both[1]) == digest:
        if refusal is not None:
            raise ValueError(refusal)
        return
    everyone = _gather(cp, (lines, list(batch_lines), refusal))
    refused = [(rank, why) for rank, (_, _, why) in enumerate(everyone) if why is not None]
    if refused and all(inputs == everyone[0][0] for inputs, _, _ in everyone):
        rank, why = refused[0]
        raise ValueError(why if rank == cp.rank else f"rank {rank} refused its batch: {why}")
    raise ValueError(
        f"the CP ranks were called with different inputs "
        f"({_first_difference([inputs + cut for inputs, cut, _ in everyone])}); every rank must pass its shard of "
        f"the same batch (a data loader that feeds the ranks of a CP group the same global batches), with equal "
        f"local lengths, batch sizes and dtypes: shard with cp_passes.shard_batch, which pads to equal shards"
    )


def collective_fingerprint(gm: torch.fx.GraphModule, collectives: set) -> list[str]:
    """The ordered collectives of a rewritten graph, each with the shapes and dtypes it moves (rank-specific
    arguments left out: every rank must issue these, in this order)."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in collectives:
            continue
        bound = bind_args(node)
        parts = []
        for name, value in bound.items():
            if name == "rank":
                continue
            val = meta_val(value)
            if isinstance(val, torch.Tensor):  # concrete sizes: a rank may have specialized a symbolic one
                parts.append(f"{name}={[hint(s) for s in val.shape]} {val.dtype}")
            elif not isinstance(value, torch.fx.Node):
                parts.append(f"{name}={value!r}")
        op = node.target.name() if hasattr(node.target, "_schema") else node.target.__name__
        out.append(f"{op}({', '.join(parts)}) at {source_line(node, code=False)}")
    return out


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=_DIGEST_BYTES).digest(), "little")


def agree_before_running(cp: CPGroup, error: BaseException | None, compiled: bool, fingerprint: list[str],
                         recompile_reasons: tuple[str, ...] | list[str] = ()) -> None:
    """Called on every rank exactly once per call, just before the graph would issue its first collective:
    at the end of a compile (``compiled``, with its error if it failed), before a cached graph runs, or where
    the capture failed before reaching the backend. One all-reduce says whether the ranks differ (a failure,
    a rank that compiled a new graph while another reuses its own, different collectives); only then are the
    reports gathered, and every rank raises the same verdict (a failed rank its own error, except that a list of
    problems the lowest failed rank found too is printed there only: the others raise a line that points to it)."""
    if alone(cp):
        return
    fp = _digest("\n".join(fingerprint)) if compiled else 0
    flags = torch.tensor([int(error is not None), int(compiled), -int(compiled), fp, -fp], dtype=torch.int64,
                         device=collective_device(cp))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=cp.group)
    failed, some_compiled, all_compiled, fp_max, fp_min = (int(flags[0]), int(flags[1]), -int(flags[2]),
                                                          int(flags[3]), -int(flags[4]))
    if not failed and some_compiled == all_compiled and fp_max == fp_min:
        return
    report = (f"{type(error).__name__}: {error}" if error is not None else None, compiled, fingerprint,
              list(recompile_reasons))
    everyone = _gather(cp, report)
    failures = [(rank, err) for rank, (err, *_) in enumerate(everyone) if err is not None]
    if failures:
        rank, err = failures[0]
        if error is not None and (rank == cp.rank or err != report[0] or not getattr(error, "problems", None)):
            return  # this rank raises its own error: the first to fail, a short one, or one that failed otherwise
        if error is not None:  # the same list of problems as a lower rank's, which prints it
            same = [r for r, e in failures if e == err]
            agreed = CPCompileError(f"rank {rank} prints why this model cannot be sharded ({counted(error.problems)}; "
                                    f"ranks {same} found the same)")
            agreed.problems = list(error.problems)
            raise agreed
        others = f" (and ranks {[r for r, _ in failures[1:]]})" if len(failures) > 1 else ""
        raise CPCompileError(f"rank {rank}{others} failed to compile, so no rank runs this graph. Rank {rank}'s "
                             f"error:\n{err}")
    new = [rank for rank, (_, made, *_) in enumerate(everyone) if made]
    if len(new) != cp.size:
        reused = [rank for rank in range(cp.size) if rank not in new]
        why = "; ".join(everyone[new[0]][3]) or "its first call"
        raise CPCompileError(
            f"ranks {new} compiled a new graph for this call while ranks {reused} reuse the graph they have, so "
            f"they would issue different collectives; no rank ran. A guard of the compiled graphs holds on some "
            f"ranks only: the model reads Python state that differs across ranks (an attribute, a flag, a "
            f"non-tensor argument), or cp_passes guarded on the rank (a bug: please report it). Rank {new[0]} "
            f"compiled because: {why}"
        )
    schedules = [fp for _, _, fp, _ in everyone]
    rank = next(r for r, fp in enumerate(schedules) if fp != schedules[0])
    mine, base = schedules[rank], schedules[0]
    i = next(i for i in range(max(len(mine), len(base))) if i >= len(mine) or i >= len(base) or mine[i] != base[i])
    raise CPCompileError(
        f"the CP ranks planned different collective schedules, which would deadlock or exchange the wrong data: "
        f"collective #{i + 1} is {mine[i] if i < len(mine) else '(none)'} on rank {rank} but "
        f"{base[i] if i < len(base) else '(none)'} on rank 0. Every rank must compile the same model with the "
        f"same spec on inputs of the same shapes; a model whose code branches on the rank cannot be sharded"
    )
