"""The training stack around CP, on real gloo process groups: activation checkpointing, FSDP2 and DDP on a
dp x cp mesh, bf16, gradient accumulation over micro-batches of different lengths. Each is checked against
the single-device model, forward and gradients, as in test_parity.py."""

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

import cp_passes
from family_models import hf_parity
from parity import GRAD_RTOL, OUT_TOL, compare, hf_reference, toy_reference
from shared import error_text, in_global_order, toy_batch, toy_model, toy_parity


def dp_cp_micro_batches(step: int, seq_lens: list[int], dp: int, replica: int | None = None) -> list[dict]:
    """The micro-batches of one step: 2 rows per replica, one global length each (an odd one padded); a
    replica's rows, or all of them (the single-device reference's concatenated batch)."""
    batches = [toy_batch(seq_len, batch=2 * dp, seed=10 * step + i) for i, seq_len in enumerate(seq_lens)]
    if replica is None:
        return batches
    rows = slice(2 * replica, 2 * replica + 2)
    return [{k: v[rows] for k, v in b.items()} for b in batches]


def bf16_step(model, mode: str, batch: dict, call=None):
    """One training step in bf16: ``mode`` "autocast" (fp32 parameters, bf16 compute) or "params" (bf16
    parameters). Returns the loss, the logits and the gradients, in fp32."""
    call = call or model
    if mode == "params":
        model.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else contextlib.nullcontext():
        loss, logits = call(**batch)
    loss.backward()
    return loss.detach().float(), logits.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}

# A causal layer (K/V gather) and a layer with a causal convolution (halo) before its attention, both
# checkpointed: the backward's recomputation issues both transports again.
CHECKPOINTED = dict(checkpoint=True, conv_kernel=(0, 4))
"""By default, checkpointing's parity is test_hf_activation_checkpointing_parity's (transformers' Llama) and its
structure tests/test_structure.py's (the transports repeated in the backward)."""


@pytest.mark.parametrize("P,backend", [pytest.param(2, "aot_eager", marks=pytest.mark.full),
                                       pytest.param(4, "aot_eager", marks=pytest.mark.full),
                                       pytest.param(2, "inductor", marks=pytest.mark.full)])
def test_checkpointed_blocks_parity(pool, parity_report, P, backend):
    seq_lens = [16, 13]
    per_rank = pool.run(toy_parity, P, backend=backend, config=CHECKPOINTED, seq_lens=seq_lens,
                        pass_positions=False)
    for i, seq_len in enumerate(seq_lens):
        compare(f"ToyLlama-checkpointed-{backend}", [r[i] for r in per_rank],
                 *toy_reference(CHECKPOINTED, seq_len, False), seq_len, parity_report)


@pytest.mark.parametrize("P", [2, pytest.param(4, marks=pytest.mark.full)])
def test_hf_activation_checkpointing_parity(pool, parity_report, P):
    """transformers' activation_checkpointing_enable() (use_reentrant=False on every decoder layer), against
    the model without it."""
    seq_lens = [16, 11]
    per_rank = pool.run(hf_parity, P, backend="aot_eager", seq_lens=seq_lens, checkpointing=True)
    for i, seq_len in enumerate(seq_lens):
        compare("hf-LlamaForCausalLM-checkpointed", [r[i] for r in per_rank], *hf_reference(seq_len, False),
                 seq_len, parity_report)


def _dp_cp_reference(steps: list[list[int]]) -> list[dict]:
    """One device on the concatenated batch: the same micro-batches and SGD steps, losses summed over tokens
    and divided by the step's token count."""
    model = toy_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    results = []
    for step, seq_lens in enumerate(steps):
        batches = dp_cp_micro_batches(step, seq_lens, 2)
        count = sum(int((b["labels"] != -100).sum()) for b in batches)
        losses = []
        for batch in batches:
            batch.pop("position_ids")
            loss, _ = model(**batch)
            (loss / count).backward()
            losses.append((loss / count).detach())
        results.append({"losses": losses, "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                        "count": count})
        optimizer.step()
        optimizer.zero_grad()
    return results


def _relative(value: torch.Tensor, reference: torch.Tensor) -> float:
    """max |value - reference| relative to the reference's largest entry; inf for a NaN (max() skips NaNs)."""
    err = ((value - reference).abs().max() / reference.abs().max()).item()
    return math.inf if math.isnan(err) else err


# Two steps of two micro-batches each, of different global lengths (11 and 13 are padded to a multiple of 2).
STEPS = [[16, 11], [13, 8]]


@pytest.mark.parametrize("wrapper", ["fsdp", pytest.param("hsdp", marks=pytest.mark.full),
                                     pytest.param("ddp", marks=pytest.mark.full)])
def test_data_parallel_over_cp_with_accumulation_parity(pool, parity_report, wrapper):
    """dp 2 x cp 2 on four gloo processes against one device on the concatenated batch, step by step: the
    wrapper sums the gradients over dp and cp, losses are normalised by the step's global token count."""
    per_rank = pool.run(dp_cp_training, 4, wrapper=wrapper, steps=STEPS)
    for step, ref in enumerate(_dp_cp_reference(STEPS)):
        ranks = [r[step] for r in per_rank]
        assert {r["count"] for r in ranks} == {ref["count"]}
        loss_err = max(_relative(sum(r["losses"][i] for r in ranks), ref_loss)
                       for i, ref_loss in enumerate(ref["losses"]))
        assert loss_err <= OUT_TOL, f"step {step}: losses differ by {loss_err} (relative)"
        for rank, r in enumerate(ranks):  # the wrapper leaves every rank the whole step's gradient
            grad_err = max(_relative(r["grads"][n], g) for n, g in ref["grads"].items())
            assert grad_err <= GRAD_RTOL, f"step {step}, rank {rank}: gradients differ by {grad_err} (relative)"
        parity_report.append((f"ToyLlama-dp2xcp2-{wrapper}-step{step}", 4, STEPS[step][0], 0.0, loss_err, grad_err))


@pytest.mark.parametrize("wrapper,error", [("fsdp_dp", "does not hold this rank's CP peers"),
                                           ("ddp_dp", "does not hold this rank's CP peers"),
                                           ("fsdp_avg", "fully_shard averages gradients over its ranks"),
                                           ("fsdp_inner", "fully_shard was applied to modules inside the CP model")])
def test_data_parallel_that_would_not_sum_over_cp_is_refused(pool, wrapper, error):
    """FSDP2 or DDP over the dp dim alone would never sum the CP ranks' shares, FSDP2 left averaging would
    divide them by the ranks, and a block sharded inside the model would split the graph at FSDP's hooks:
    refused before anything compiles, naming what to do, on every rank alike (the pool's ranks stay in step)."""
    for refusal in pool.run(refused_dp_cp_training, 4, wrapper=wrapper):
        assert error in refusal, refusal


def _errors(loss, logits, grads, reference) -> tuple[float, float, float]:
    """Relative loss error, max |logit error|, and the worst parameter's max gradient error relative to that
    gradient's largest entry, against the fp32 single-device ``reference``."""
    ref_loss, ref_logits, ref_grads = reference
    logits_err = (logits - ref_logits).abs().max().item()
    return (_relative(loss, ref_loss), math.inf if math.isnan(logits_err) else logits_err,
            max(_relative(grads[n], g) for n, g in ref_grads.items()))


def _loss_error_scale(logits, reference, labels) -> float:
    """What bf16 does to the summed loss on one device, without the luck of cancellation: the sum over tokens
    of each token's |bf16 - fp32| loss error, relative to the loss. (The summed loss's own error is a sum of
    signed errors and cancels by chance: 1.6e-5 on one device against 6.9e-5 under CP at P = 2 for the same
    per-token error.)"""
    def per_token(x):
        return F.cross_entropy(x.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none")

    return ((per_token(logits) - per_token(reference[1])).abs().sum() / reference[0].abs()).item()


BF16_CASES = [pytest.param("autocast", 2, "aot_eager", {"window": 5, "conv_kernel": 4}, 16, marks=pytest.mark.full),
              ("params", 2, "aot_eager", {"window": 5, "conv_kernel": 4}, 16),
              pytest.param("autocast", 4, "aot_eager", {}, 64, marks=pytest.mark.full),
              pytest.param("params", 4, "aot_eager", {}, 64, marks=pytest.mark.full),
              pytest.param("autocast", 2, "inductor", {}, 64, marks=pytest.mark.full)]


@pytest.mark.parametrize("mode,P,backend,config,seq_len", BF16_CASES)
def test_bf16_parity_within_twice_the_single_device_bf16_error(pool, parity_report, mode, P, backend, config,
                                                                seq_len):
    """bf16 autocast (fp32 parameters) and bf16 parameters: CP's error against the fp32 single-device model
    stays within 2x of what bf16 does to the single-device model itself: logits and every gradient directly,
    the summed loss against the per-token error sum (see _loss_error_scale)."""
    batch = toy_batch(seq_len)
    batch.pop("position_ids")
    model = toy_model(**config)
    loss, logits = model(**batch)
    loss.backward()
    reference = (loss.detach(), logits.detach(), {n: p.grad for n, p in model.named_parameters()})
    one_device = bf16_step(toy_model(**config), mode, dict(batch))
    _, one_logits_err, one_grad_err = _errors(*one_device, reference)
    loss_scale = _loss_error_scale(one_device[1], reference, batch["labels"])

    per_rank = pool.run(bf16_parity, P, mode=mode, seq_len=seq_len, config=config, backend=backend)
    logits = in_global_order(per_rank, "logits")[:, :seq_len]
    grads = {n: sum(r["grads"][n] for r in per_rank) for n in reference[2]}
    loss_err, logits_err, grad_err = _errors(sum(r["loss"] for r in per_rank), logits, grads, reference)
    parity_report.append((f"ToyLlama-bf16-{mode}-{backend} (vs fp32; 2x one-device bf16: logits "
                          f"{2 * one_logits_err:.1e}, grads {2 * one_grad_err:.1e})", P, seq_len, logits_err, loss_err,
                          grad_err))
    assert logits_err <= 2 * one_logits_err, f"logits: {logits_err} against one device's bf16 error {one_logits_err}"
    assert grad_err <= 2 * one_grad_err, f"gradients: {grad_err} against one device's bf16 error {one_grad_err}"
    assert loss_err <= 2 * loss_scale, f"loss: {loss_err} against one device's per-token bf16 error {loss_scale}"


# Tasks the worker pool's ranks run (pool.run(task, P, ...)).


def refused_dp_cp_training(group, wrapper: str) -> str:
    """A refused arrangement's first step: the error text every rank raises."""
    return error_text(lambda: dp_cp_training(group, wrapper=wrapper, steps=STEPS[:1]))


def dp_cp_training(group, wrapper: str, steps: list[list[int]], backend: str = "aot_eager") -> dict:
    """Four ranks as dp 2 x cp 2: cp_compile over the cp dim, the data-parallel ``wrapper`` over a mesh that
    holds the cp ranks ("fsdp": FSDP2 over the flattened mesh, torchtitan's arrangement; "hsdp": FSDP2 on the
    2-D mesh; "ddp": DDP over the flattened group; refused: "fsdp_dp" and "ddp_dp" over dp alone, "fsdp_avg"
    averaging, "fsdp_inner" a block sharded inside the CP model). Each
    step accumulates micro-batches of the given global lengths, each summed loss divided by the step's global
    token count, the wrapper summing gradients; an SGD update between steps. Returns, per step, this rank's
    losses and every full gradient."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    assert torch.distributed.get_world_size(group) == 4
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    model = toy_model()
    compiled = cp_passes.cp_compile(model, mesh=mesh["cp"], backend=backend, verbose=False)
    flat = mesh["dp", "cp"]._flatten("dp_cp")
    if wrapper.startswith("ddp"):
        group = mesh["dp"].get_group() if wrapper == "ddp_dp" else flat.get_group()
        compiled = DistributedDataParallel(compiled, process_group=group)
    else:
        if wrapper == "fsdp_inner":
            fully_shard(model.layers[0], mesh=flat)
        fully_shard(compiled, mesh={"fsdp": flat, "fsdp_inner": flat, "fsdp_avg": flat, "hsdp": mesh,
                                    "fsdp_dp": mesh["dp"]}[wrapper])
    if wrapper != "fsdp_avg":
        cp_passes.sum_gradients(compiled)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    replica, results = mesh["dp"].get_local_rank(), []
    for step, seq_lens in enumerate(steps):
        local = [cp_passes.shard_batch(b, mesh["cp"])[0] for b in dp_cp_micro_batches(step, seq_lens, 2, replica)]
        count = cp_passes.global_token_count([b["labels"] for b in local], mesh)
        losses = []
        for i, batch in enumerate(local):
            batch.pop("position_ids")
            # DDP reduces the whole accumulated gradient at each backward: sync at the last micro-batch only
            last = i == len(local) - 1
            with compiled.no_sync() if wrapper == "ddp" and not last else contextlib.nullcontext():
                loss, _ = compiled(**batch)
                (loss / count).backward()
            losses.append((loss / count).detach())
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                 for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        results.append({"losses": losses, "grads": grads, "count": int(count)})
    return results


def bf16_parity(group, mode: str, seq_len: int, config: dict, backend: str = "aot_eager") -> dict:
    model = toy_model(**config)
    compiled = cp_passes.cp_compile(model, mesh=group, backend=backend, verbose=False)
    local, layout = cp_passes.shard_batch(toy_batch(seq_len), group)
    local.pop("position_ids")
    loss, logits, grads = bf16_step(model, mode, local, compiled)
    return {"loss": loss, "logits": logits, "grads": grads, "valid": layout.valid, "positions": layout.positions}
