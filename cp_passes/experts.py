"""MoE experts named in ``CPSpec.experts`` run through transformers' ``grouped_mm`` experts forward.

transformers generates some experts classes without its experts-implementation switch (``Step3p7Experts`` in
5.24): their forward loops over the experts ``nonzero()`` selects, a loop whose length is data, which dynamo
cannot trace into one graph. The families with the switch run ``grouped_mm_experts_forward`` by default: sort the
(token, expert) pairs by expert, one grouped matmul per projection, put the rows back. It computes the same sum
over each token's experts from the same stacked weights, and cp_passes proves it local to each rank
(:mod:`cp_passes.rules.permutations`). :func:`install` gives each named module that forward and the attributes
the switch would have set; the class and every other instance stay as they were.
"""

from __future__ import annotations

import fnmatch
import types

import torch


def install(model: torch.nn.Module, globs: tuple[str, ...]) -> list[str]:
    """Run the experts modules of ``model`` that ``globs`` name through transformers' grouped_mm forward;
    returns their paths."""
    if not globs:
        return []
    from transformers.integrations.moe import _default_apply_gate, grouped_mm_experts_forward

    installed = []
    for path, module in model.named_modules():
        if not any(fnmatch.fnmatchcase(path, glob) for glob in globs):
            continue
        _check_weights(path, module)
        experts = module.gate_up_proj.shape[0]
        defaults = dict(num_experts=experts, has_gate=True, has_bias=False, has_post_expert_norm=False,
                        is_transposed=False, is_concatenated=True, _is_expert_parallel=False)
        for name, value in defaults.items():
            if not hasattr(module, name):
                setattr(module, name, value)
        if not hasattr(module, "_apply_gate"):
            module._apply_gate = types.MethodType(_default_apply_gate, module)
        module.forward = types.MethodType(grouped_mm_experts_forward, module)
        installed.append(path)
    return installed


def _check_weights(path: str, module: torch.nn.Module) -> None:
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    shapes = (getattr(gate_up, "shape", None), getattr(down, "shape", None))
    ok = (all(s is not None and len(s) == 3 for s in shapes) and shapes[0][0] == shapes[1][0]
          and shapes[0][1] == 2 * shapes[1][2] and shapes[0][2] == shapes[1][1] and hasattr(module, "act_fn"))
    if not ok:
        raise ValueError(
            f"CPSpec.experts names {path!r} ({type(module).__name__}), whose weights are not stacked as transformers' "
            f"grouped_mm experts read them (gate_up_proj [E, 2I, H] and down_proj [E, H, I] with an act_fn; got "
            f"gate_up_proj {shapes[0]}, down_proj {shapes[1]}): remove it from experts and run the model with an "
            f"experts implementation it supports")
