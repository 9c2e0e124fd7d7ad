"""Per-rank memory of a CP training step against one device's divided by P: what the forward saves for the
backward, and the largest [sequence x sequence] tensor (a mask) per rank and layer against ``L x keys
brought``. From dry runs (fake tensors, a fake process group): AOTAutograd partitions the rewritten graph and
the single-device one with min-cut, as ``cp_compile`` lowers them. Shapes decide these figures, so a packed
batch's document lengths do not: they change which key blocks attention computes, not what is kept.

    python benchmarks/memory.py                              # llama-8b, P = 8, S = 131072, bf16, batch 1
    python benchmarks/memory.py --world-size 64 --seq-len 1048576
    python benchmarks/memory.py --model mixtral-moe --seq-len 4096

The MoE models are transformers' (``MixtralForCausalLM``, ``OlmoeForCausalLM``), each on its default experts
implementation (grouped_mm: the rank's tokens sorted by expert, grouped matmuls, no bytes between ranks) and
on batched_mm, the anti-example, which gathers every token's experts' weights. transformers builds their
masks from the positions, which cp_passes evaluates as tensors up to 4100 positions today, so their global
length is at most 4096.
"""

import argparse
import sys

import torch
from tabulate import tabulate

from cp_passes.report.explain import format_bytes
from cp_passes.spec import CPSpec
from cp_passes.tools.dryrun import dry_run, fake_group
from cp_passes.tools.models import EXAMPLES, built_in

TARGET = 1.25

MOE = {
    "mixtral-moe": ("MixtralForCausalLM: 2 layers, hidden 1024, 8 experts (ffn 2048), top 2",
                    "MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=8)),
    "olmoe": ("OlmoeForCausalLM: 2 layers, hidden 1024, 16 experts (ffn 1024), top 4", "OlmoeConfig",
              "OlmoeForCausalLM", dict(num_experts=16, num_experts_per_tok=4, intermediate_size=1024)),
}
"""MoE models from transformers: name -> (description, config class, model class, config fields)."""


def moe_model(name: str, experts: str, dtype: torch.dtype):
    import transformers

    _, config_cls, model_cls, fields = MOE[name]
    config = getattr(transformers, config_cls)(**{
        "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 4, "num_experts_per_tok": 2, "use_cache": False,
        **fields})
    config._experts_implementation = experts
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return getattr(transformers, model_cls)(config)
    finally:
        torch.set_default_dtype(default)


def measure_moe(args, experts: str):
    world, local = args.world_size, args.seq_len // args.world_size
    inputs = {"input_ids": ((args.batch, local), torch.long), "labels": ((args.batch, local), torch.long)}
    with fake_group(world, world - 1) as group:
        run = dry_run(lambda: moe_model(args.model, experts, getattr(torch, args.dtype)), inputs, CPSpec(),
                      mesh=group, memory=True)
    return run.memory


def main_moe(args) -> None:
    if args.seq_len > 4096:
        raise SystemExit(f"--seq-len {args.seq_len}: transformers' masks are evaluated as tensors up to 4100 "
                         f"positions today; pass --seq-len 4096 or less for {args.model}")
    rows, ok = [], True
    for experts in ("grouped_mm", "batched_mm"):
        print(f"partitioning {experts} ...", file=sys.stderr, flush=True)
        memory = measure_moe(args, experts)
        if experts == "grouped_mm":
            ok = memory.ratio <= TARGET
        rows.append([experts + (" (default)" if experts == "grouped_mm" else " (anti-example)"),
                     format_bytes(memory.saved_bytes), format_bytes(memory.single_share), f"{memory.ratio:.3f}",
                     format_bytes(memory.collective.bytes)])
    print(f"{MOE[args.model][0]}, P = {args.world_size}, S = {args.seq_len} "
          f"({args.seq_len // args.world_size} per rank), batch {args.batch}, {args.dtype}; rank {args.world_size - 1}")
    print(tabulate(rows, headers=["experts", "saved / rank", "one device / P", "saved ratio", "largest collective"]))
    print(f"target: grouped_mm saved ratio <= {TARGET}: {'met' if ok else 'NOT met'}")


def measure(args, packed: bool):
    world, local = args.world_size, args.seq_len // args.world_size
    rank = world - 1  # brings the most keys
    inputs = {"input_ids": ((args.batch, local), torch.long), "labels": ((args.batch, local), torch.long)}
    if packed:
        inputs["doc_ids"] = ((args.batch, local), torch.long)
    config = EXAMPLES[args.model][1]
    with fake_group(world, rank) as group:
        run = dry_run(lambda: built_in(config, getattr(torch, args.dtype)), inputs,
                      CPSpec(gathered_keys=args.gathered_keys, layout=args.layout), mesh=group, memory=True)
    return run.memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(EXAMPLES) + sorted(MOE), default="llama-8b",
                        help="built-in example, or a transformers MoE model")
    parser.add_argument("--world-size", type=int, default=8, help="CP ranks (default: 8)")
    parser.add_argument("--seq-len", type=int, default=131072, help="global sequence length (default: 131072)")
    parser.add_argument("--batch", type=int, default=1, help="batch size (default: 1)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--gathered-keys", choices=("regather", "save"), default="regather",
                        help="CPSpec.gathered_keys (default: regather, the default)")
    parser.add_argument("--layout", choices=("auto", "balanced", "contiguous"), default="auto",
                        help="CPSpec.layout (default: auto: balanced here)")
    args = parser.parse_args()
    if args.seq_len % args.world_size:
        raise SystemExit("--seq-len must be a multiple of --world-size")
    if args.model in MOE:
        return main_moe(args)
    local = args.seq_len // args.world_size
    rows, ok = [], True
    for packed in (False, True):
        print(f"partitioning {'packed' if packed else 'unpacked'} ... (about a minute)", file=sys.stderr, flush=True)
        memory = measure(args, packed)
        bound = args.batch * local * args.seq_len  # the last rank's queries x its causal prefix: every key
        ok &= memory.ratio <= TARGET and memory.quadratic.elements <= bound
        rows.append(["packed (doc_ids)" if packed else "unpacked", format_bytes(memory.saved_bytes),
                     format_bytes(memory.single_share), f"{memory.ratio:.3f}",
                     f"{format_bytes(memory.quadratic.bytes)} {memory.quadratic.what.split(' in ')[0]}",
                     f"{memory.quadratic.elements / bound:.3f}", format_bytes(memory.single_quadratic.bytes),
                     format_bytes(memory.collective.bytes)])
    print(f"{args.model}, P = {args.world_size}, S = {args.seq_len} ({local} per rank), batch {args.batch}, "
          f"{args.dtype}, gathered_keys={args.gathered_keys}; rank {args.world_size - 1} (brings every key)")
    print(tabulate(rows, headers=["batch", "saved / rank", "one device / P", "saved ratio", "largest mask / rank",
                                  "mask elements / (L x keys)", "one device's mask", "largest collective"]))
    print(f"target: saved ratio <= {TARGET}, mask elements <= L x keys brought per layer: "
          f"{'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
