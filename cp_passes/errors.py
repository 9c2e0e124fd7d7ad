"""Compile-time refusals and the node provenance they print."""

from __future__ import annotations

import ast
import inspect
import os
import re
import sys
import traceback
from dataclasses import dataclass

import torch
import torch.fx

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_HF_CACHE = "transformers/cache_utils.py:"
_CACHE_FIX = "call the model with use_cache=False: a training step never reads the cache"


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


def node_ref(node: torch.fx.Node, code: bool = True) -> str:
    """``node`` as the model's code names it: the source text that made it and its line (``'k.transpose(1, 2)'
    at modeling_x.py:120``; the line alone without ``code``), else the graph's name for it."""
    where = source_line(node)
    if where == "<no source line>":
        return f"'{node.name}'"
    place, _, text = where.partition(": ")
    place = place.split(" in ")[0]
    if not code:
        return place
    return f"'{text or node.name}' at {place}"


def _frames(node: torch.fx.Node) -> list[tuple[str, int, str]]:
    """``(file, line, function)`` of every frame of the stack trace that produced ``node``, outermost first."""
    trace = node.meta.get("stack_trace") or ""
    return [(m.group(1), int(m.group(2)), m.group(3))
            for m in re.finditer(r'^\s*File "(.+)", line (\d+), in (\S+)', trace, re.MULTILINE)]


def _module_named_by(filename: str):
    for module in list(sys.modules.values()):
        if getattr(module, "__file__", None) == filename:
            return module
    return None


def kernel_call(node: torch.fx.Node) -> tuple[str, str, inspect.Signature | None] | None:
    """The module-level function the innermost ``forward`` called on the way to ``node`` (a kernel such as
    ``torch_chunk_gated_delta_rule``): ``("package.module:function", "file:line" of the call, its signature)``,
    or None where the op is in ``forward`` itself or in no function a spec can name."""
    frames = _frames(node)
    last = max((i for i, (file, _, fn) in enumerate(frames) if fn == "forward" and not file.startswith(_TORCH_DIR)),
               default=None)
    if last is None:
        return None
    for file, _, fn in frames[last + 1:]:
        module = _module_named_by(file)
        target = getattr(module, fn, None) if module is not None else None
        if callable(target):
            call_file, call_line, _ = frames[last]
            try:
                signature = inspect.signature(target)
            except (TypeError, ValueError):
                signature = None
            return f"{module.__name__}:{fn}", f"{'/'.join(call_file.split('/')[-2:])}:{call_line}", signature
    return None


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


_NODE_COUNT = re.compile(r"\b([a-z][a-z0-9_]*?)_\d+\b")
"""A graph node's name with the count FX adds to repeats (``view_12``)."""


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
        source = source_line(node)
        if source.startswith(_HF_CACHE):  # a KV cache's update: the training step never reads it
            fix = _CACHE_FIX
        return cls(op_name(node), source, module_path(node), reason, fix)

    def format(self, index: int | None = None, modules: list[str] | None = None) -> str:
        """The problem as printed; ``modules``: every module it occurs in (the same op, line, reason and fix)."""
        head = f"[{index}] " if index is not None else ""
        modules = modules if modules is not None else [self.module] if self.module else []
        names = ", ".join(modules if len(modules) <= 4 else modules[:3] + [f"... {modules[-1]}"])
        where = (self.source + (f"  (module {names})" if len(modules) == 1 else
                                f"  (in {len(modules)} modules: {names})" if modules else ""))
        return f"{head}{self.op} at {where}\n    why: {self.reason}\n    fix: {self.fix}"

    def key(self) -> tuple[str, str, str, str]:
        """What makes two problems one: the op at the same source line, for the same reason and fix (each layer
        of a model repeats its block's), graph node names (``'view_12'``) read without their count."""
        return self.op, self.source, _NODE_COUNT.sub(r"\1", self.reason), _NODE_COUNT.sub(r"\1", self.fix)


def grouped(problems: list[Problem]) -> list[tuple[Problem, list[str]]]:
    """Each distinct problem once, in order of first occurrence, with the modules it occurs in."""
    groups: dict[tuple, tuple[Problem, list[str]]] = {}
    for problem in problems:
        _, modules = groups.setdefault(problem.key(), (problem, []))
        if problem.module and problem.module not in modules:
            modules.append(problem.module)
    return list(groups.values())


_SITE = re.compile(r"(.+?):(\d+) in (\w+)")

LOOP_FIX = ("move the loop into a function (or a method that computes from its arguments alone) and declare it in the "
            "spec, CPSpec(recurrences=(Recurrence('module:function', ...),)), which carries its state from rank to "
            "rank; in a package's forward you cannot edit, lift the loop into a copy of that forward and declare "
            "both, CPSpec(lifted_forwards=(LiftedForward('module:Class.forward', 'yours:forward', sha),), "
            "recurrences=...) (model_specs/minimax.py does it for MiniMax's lightning attention); or keep the loop "
            "outside the compiled module")


def unrolled_loops(problems: list[Problem]) -> list[Problem]:
    """``problems`` with each Python loop over the sequence told once. Dynamo unrolls such a loop at the compile-time
    length, so one line's op appears with different reasons (each iteration slices other positions): every problem
    in that function and module then becomes one, "a loop over the sequence written in Python at ...", with the fix
    that serves a loop (declare it as a recurrent kernel); its submodules' problems, on what the loop made, go with
    it."""
    groups: dict[tuple, list[tuple[Problem, str, int]]] = {}
    for problem in problems:
        m = _SITE.match(problem.source)
        if m:
            key = (m.group(1), m.group(3), problem.module)
            groups.setdefault(key, []).append((problem, m.group(1), int(m.group(2))))
    loops = {}
    for key, found in groups.items():
        reasons: dict[tuple, set] = {}
        for problem, _, line in found:
            reasons.setdefault((problem.op, line), set()).add(problem.reason)
        if any(len(r) > 1 for r in reasons.values()):
            loops[key] = found
    if not loops:
        return problems
    out, told = [], set()
    inside = tuple(f"{module}." for _, _, module in loops if module)
    for problem in problems:
        m = _SITE.match(problem.source)
        key = (m.group(1), m.group(3), problem.module) if m else None
        if key not in loops and problem.module.startswith(inside) and inside:
            continue  # a submodule's op on what the loop made (its sizes are the unrolled iterations')
        if key not in loops:
            out.append(problem)
        elif key not in told:
            told.add(key)
            lines = [line for _, _, line in loops[key]]
            first = min(loops[key], key=lambda f: f[2])[0]
            out.append(Problem("a Python loop", f"{key[0]}:{min(lines)}-{max(lines)} in {key[1]}", key[2],
                               f"a loop over the sequence written in Python (dynamo unrolled it at this length: "
                               f"{len(loops[key])} ops of its iterations read positions, the first {first.op} at line "
                               f"{min(lines)}: {first.reason}); under CP each rank would run it over its own "
                               f"positions alone", LOOP_FIX))
    return out


def counted(problems: list[Problem]) -> str:
    """``"13 problems, at 28 places"``: the distinct problems (:func:`grouped`) and, where more, their sites."""
    count = len(grouped(problems))
    sites = f", at {len(problems)} places" if len(problems) > count else ""
    return f"{count} problem{'s' if count > 1 else ''}{sites}"


class CPCompileError(RuntimeError):
    """The graph holds something cp_passes cannot prove correct under sequence sharding."""

    internal: BaseException | None = None
    """For a failure inside cp_passes (not a refusal): the error it raised, with its traceback, which the
    wrapper chains as this error's ``__cause__``."""

    def __init__(self, problems: list[Problem] | str):
        if isinstance(problems, str):
            self.problems: list[Problem] = []
            super().__init__(problems)
            return
        self.problems = list(problems)
        body = "\n".join(p.format(i + 1, modules) for i, (p, modules) in enumerate(grouped(self.problems)))
        super().__init__(f"cp_passes cannot shard this model along the sequence ({counted(self.problems)}):\n{body}")


def _chain(error: BaseException):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__


def _trimmed(error: BaseException, lines: int = 30) -> str:
    text = str(error).strip().splitlines()
    return "\n".join(text[:lines] + (["    ..."] if len(text) > lines else []))


def compile_error(error: BaseException, model: torch.nn.Module | None = None) -> CPCompileError:
    """Whatever stopped dynamo's capture (or the backend: its CPCompileError is inside dynamo's wrapper), as a
    CPCompileError that says what construct it was and what to do (for ``model``'s own modules, where it can
    tell)."""
    known = _recognised(error, model)
    if known is not None:
        return known
    return CPCompileError(f"cp_passes could not capture the model ({type(error).__name__}):\n{_trimmed(error)}")


def experts_fix(model: torch.nn.Module | None, said: str) -> str | None:
    """How to run ``model``'s transformers MoE experts without their loop over the experts ``nonzero()``
    selects (which dynamo cannot trace): transformers' grouped_mm implementation, which cp_passes proves local.
    Only where dynamo's message ``said`` points into the file that defines the experts."""
    for name, module in (model.named_modules() if model is not None else ()):
        cls = type(module)
        if not (cls.__name__.endswith("Experts") and cls.__module__.startswith("transformers.")):
            continue
        if os.path.basename(inspect.getsourcefile(cls)) not in said:
            continue
        if not hasattr(module, "_is_expert_parallel"):  # what transformers' use_experts_implementation sets
            glob = "*" + ".".join(name.split(".")[-2:])  # every layer's: layers.1.mlp.experts -> *mlp.experts
            return (f"'{name}' ({cls.__name__}) has no experts-implementation switch in this transformers version: "
                    f"name it in the spec, CPSpec(experts=({glob!r},)), and it runs through transformers' grouped_mm "
                    f"experts forward")
        if getattr(getattr(module, "config", None), "_experts_implementation", None) in (None, "eager"):
            return (f"'{name}' ({cls.__name__}) runs its eager loop: model.set_experts_implementation(\"grouped_mm\") "
                    f"(transformers' default)")
    return None


def _raised(observed: BaseException) -> tuple[str, str] | None:
    """The name and message of the exception the traced code raised, from dynamo's text for it (``raised
    exception ValueError("...")``: dynamo keeps no exception object), or None where that is not its form."""
    found = re.search(r"raised exception (\w+)\((.*)\)\s*$", str(observed), re.DOTALL)
    if found is None:
        return None
    try:
        message = ast.literal_eval(found[2]) if found[2] else ""
    except (ValueError, SyntaxError):
        return None
    return (found[1], message) if isinstance(message, str) else None


def _recognised(error: BaseException, model: torch.nn.Module | None = None) -> CPCompileError | None:
    """The CPCompileError for an error whose cause cp_passes can name, else None."""
    from torch._dynamo import exc
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    chain = list(_chain(error))
    own = next((e for e in chain if isinstance(e, CPCompileError)), None)
    if own is not None:
        return own
    data_dependent = next((e for e in chain if isinstance(e, GuardOnDataDependentSymNode)), None)
    experts = (experts_fix(model, _trimmed(data_dependent or error))
               if data_dependent is not None or isinstance(error, exc.UserError) else None)
    if data_dependent is not None:
        fix = experts or ("compute such sizes outside the compiled module and pass them in, or use a form with "
                          "static shapes (masks instead of boolean indexing)")
        return CPCompileError(
            "the model computes a shape or a branch from tensor data (.tolist(), .item(), the size of nonzero() or "
            f"of a boolean-mask index), which cannot be traced into one graph. Fix: {fix}. Dynamo said:\n"
            f"{_trimmed(data_dependent)}"
        )
    if isinstance(error, exc.FailOnRecompileLimitHit):
        return CPCompileError(
            "dynamo reached its limit of graphs for this model (torch._dynamo.config.recompile_limit): every new "
            "local length shorter than a halo compiles a graph of its own, and so do changed guards (explain() "
            "lists each graph and why it was compiled). Fix: keep the local length fixed or at least the largest "
            "halo (shard_batch's pad_multiple=), or raise the limit"
        )
    if isinstance(error, exc.UserError):
        fix = (f"Fix: {experts}" if experts else "Fix: use a form without it (transformers MoE models: "
               "experts_implementation=\"grouped_mm\", the default), or run that part outside the compiled module")
        return CPCompileError(
            "dynamo refused a construct in the model (typically Python control flow on tensor values, such as a "
            f"loop over the experts that nonzero() selects). {fix}. Dynamo said:\n{_trimmed(error)}"
        )
    raised = next((_raised(e) for e in chain if isinstance(e, exc.ObservedException)), None)
    if raised is not None:
        name, message = raised
        where = str(error).partition("from user code:")[2].partition("Set TORCHDYNAMO_VERBOSE")[0].rstrip()
        return CPCompileError(f"the model raised {name} while dynamo traced it: {message}"
                              + (f"\nat (innermost last):{where}" if where else ""))
    if isinstance(error, exc.Unsupported):
        said = _trimmed(error)
        # transformers logs when activation checkpointing turns a configured cache off: a graph break
        fix = f" Fix: {_CACHE_FIX}." if "is incompatible with gradient checkpointing" in said else ""
        return CPCompileError(
            "cp_passes needs the whole forward as one graph (code outside it would run on a local shard "
            f"unchecked), but dynamo could not trace it.{fix} Dynamo said:\n{said}"
        )
    return None


def stage_error(error: BaseException, stage: str, backend: str) -> CPCompileError:
    """An error raised in the backend at ``stage`` ("capture", "rewrite", "lowering", "record"), named by it."""
    if isinstance(error, CPCompileError):
        return error
    if stage == "lowering":
        failure = CPCompileError(
            f"lowering the rewritten graph with {backend} failed ({type(error).__name__}); cp_passes rewrote it "
            f"without error, so this is a bug in cp_passes' output or in the compiler. backend=\"aot_eager\" runs "
            f"the same graph without Inductor. The compiler said:\n{_trimmed(error)}\n{innermost_frames(error)}"
        )
        failure.internal = error
        return failure
    known = _recognised(error) if stage == "capture" else None
    if known is not None:
        return known
    what = {"capture": "re-tracing the captured graph to ATen", "rewrite": "rewriting the graph",
            "record": "recording the compile (structured trace, dump_dir)"}[stage]
    failure = CPCompileError(f"cp_passes failed while {what} ({type(error).__name__}): {_trimmed(error)}\n"
                             f"{innermost_frames(error)}\n"
                             f"This is a cp_passes bug unless the message says otherwise; please report it with "
                             f"these frames (the full traceback is chained below this error).")
    failure.internal = error
    return failure


def innermost_frames(error: BaseException, count: int = 4) -> str:
    """The last ``count`` frames of ``error``'s traceback inside cp_passes, and the frame that raised it when
    that is elsewhere (torch, a user function cp_passes called), one ``file:line in function: code`` a line."""
    frames = traceback.extract_tb(error.__traceback__)
    shown = [f for f in frames if os.path.abspath(f.filename).startswith(_OWN_DIR)][-count:]
    if frames and (not shown or shown[-1] is not frames[-1]):
        shown.append(frames[-1])
    if not shown:
        return "raised at: <no traceback>"
    lines = [f"  {'/'.join(f.filename.split(os.sep)[-3:])}:{f.lineno} in {f.name}" + (f": {f.line}" if f.line else "")
             for f in shown]
    return "raised at (innermost last):\n" + "\n".join(lines)
