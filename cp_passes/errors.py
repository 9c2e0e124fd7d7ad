"""Compile-time refusals and the node provenance they print."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
import torch.fx

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def source_line(node: torch.fx.Node, code: bool = True) -> str:
    """``file:line in fn: code`` of the innermost non-torch frame that produced ``node``."""
    trace = node.meta.get("stack_trace") or ""
    lines = trace.rstrip().splitlines()
    frames = [(i, m) for i, m in ((i, re.match(r'\s*File "(.+)", line (\d+), in (\S+)', line))
                                  for i, line in enumerate(lines)) if m]
    if not frames:
        return "<no source line>"
    user = [(i, m) for i, m in frames if not m.group(1).startswith(_TORCH_DIR)]
    i, m = (user or frames)[-1]
    text = ""
    if code and i + 1 < len(lines) and not lines[i + 1].strip().startswith("File "):
        text = lines[i + 1].strip()
    short = "/".join(m.group(1).split("/")[-2:])
    return f"{short}:{m.group(2)} in {m.group(3)}" + (f": {text}" if text else "")


def module_path(node: torch.fx.Node) -> str:
    """Dotted path of the innermost ``nn.Module`` that produced ``node`` (``layers.0.attn``)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    path = re.sub(r"^L\['[^']*'\](\[\d+\])?\.?", "", path)  # the root: L['self'], or L['args'][0] under decorators
    path = re.sub(r"\._modules\['([^']*)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']*)'\]", r".\1", path)
    return path.lstrip(".")


def op_name(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return f"{node.op} {target}"
    name = getattr(target, "__name__", None) or str(target)
    if hasattr(target, "_schema"):
        name = str(target)
    return name


@dataclass
class Problem:
    """One node that cp_passes cannot shard, with the reason and the fix."""

    op: str
    source: str
    module: str
    reason: str
    fix: str

    @classmethod
    def at(cls, node: torch.fx.Node, reason: str, fix: str) -> "Problem":
        return cls(op_name(node), source_line(node), module_path(node), reason, fix)

    def format(self, index: int | None = None) -> str:
        head = f"[{index}] " if index is not None else ""
        where = self.source + (f"  (module {self.module})" if self.module else "")
        return f"{head}{self.op} at {where}\n    why: {self.reason}\n    fix: {self.fix}"


class CPCompileError(RuntimeError):
    """The graph holds something cp_passes cannot prove correct under sequence sharding."""

    def __init__(self, problems: list[Problem] | str):
        if isinstance(problems, str):
            self.problems: list[Problem] = []
            super().__init__(problems)
            return
        self.problems = list(problems)
        count = len(self.problems)
        body = "\n".join(p.format(i + 1) for i, p in enumerate(self.problems))
        super().__init__(
            f"cp_passes cannot shard this model along the sequence ({count} problem{'s' if count > 1 else ''}):\n{body}"
        )
