"""A model that cp_passes cannot prove right is refused with a message that says what and how to fix it;
plain mistakes in a spec or a call are errors, not crashes or silent no-ops. Fake process group."""

import pytest
import torch
import torch.nn as nn

import cp_passes
from cp_passes import CPCompileError, CPSpec


def toy():
    from shared import toy_model

    return toy_model()


def kimi_linear():
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    config = KimiLinearConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16,
        qk_nope_head_dim=16, linear_head_dim=16, linear_num_heads=4, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention"], use_cache=False, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return KimiLinearForCausalLM(config).float()


def linear_hybrid(name):
    """A tiny transformers model whose linear-attention or Mamba-2 layers run a chunked recurrence in torch."""
    import transformers

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if name == "Qwen3Next":
        config = transformers.Qwen3NextConfig(
            **common, head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, layer_types=["linear_attention", "full_attention"])
    elif name == "Bamba":
        config = transformers.BambaConfig(**common, mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1,
                                          mamba_d_state=16, mamba_chunk_size=16, attn_layer_indices=[1])
    else:
        config = getattr(transformers, f"{name}Config")(**common)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return getattr(transformers, f"{name}ForCausalLM")(config).float()


@pytest.mark.parametrize("name,kernel,chunk", [
    ("Qwen3Next", "qwen3_next.modeling_qwen3_next:torch_chunk_gated_delta_rule", 64),
    pytest.param("OlmoHybrid", "olmo_hybrid.modeling_olmo_hybrid:torch_chunk_gated_delta_rule", 64,
                 marks=pytest.mark.full),
    pytest.param("Bamba", "bamba.modeling_bamba:mamba2_chunk_scan", 16, marks=pytest.mark.full),
])
def test_a_chunked_recurrence_without_a_spec_is_refused_naming_the_kernel(group, name, kernel, chunk):
    """With the defaults (CPSpec(); spec=None picks the shipped spec), the torch fallback of a linear-attention or
    Mamba-2 layer pads the sequence up to whole chunks by a width computed in the graph: that is refused naming
    the kernel and the shipped spec that declares it, where cp_passes used to fail comparing the width (an FX
    node) to 0."""
    compiled = cp_passes.cp_compile(linear_hybrid(name), cp_passes.CPSpec(), mesh=group, backend="aot_eager",
                                    verbose=False)
    with pytest.raises(CPCompileError) as info:
        compiled(input_ids=torch.randint(3, 128, (1, 64)))
    first = info.value.problems[0]
    assert first.op == "aten.pad.default" and f"up to a multiple of {chunk}" in first.reason, str(info.value)
    assert kernel.split(":")[1] in first.reason, first.reason
    spec = kernel.split(".")[0]
    assert f"model_specs/{spec}.py: cp_compile(model) picks it" in first.fix, first.fix
    assert "cp_passes bug" not in str(info.value)


def test_a_model_that_fixes_the_sequence_length_is_refused_naming_the_line(group):
    """Kimi Delta Attention's torch fallback loops over 64-token chunks: the activations' length becomes the
    constant 64 while position_ids keep a symbol. This ran with no exchange at all and wrong logits (with the
    defaults: spec=None picks model_specs/kimi_linear.py, which declares the kernel)."""
    compiled = cp_passes.cp_compile(kimi_linear(), cp_passes.CPSpec(), mesh=group, backend="aot_eager",
                                    verbose=False)
    with pytest.raises(CPCompileError) as info:
        compiled(input_ids=torch.randint(0, 128, (1, 64)), position_ids=torch.arange(64)[None] + 3 * 64)
    message = str(info.value)
    assert "the tracer specialized the local sequence length of input 'input_ids' to 64" in message
    assert "modeling_kimi_linear.py" in message and "in chunk_kimi_delta_attention" in message


class ChunkedTokens(nn.Module):
    """Tokens reshaped into fixed chunks of 8 (the length becomes a constant); positions only summed."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 8)

    def forward(self, ids, position_ids):
        x = self.embed(ids).reshape(ids.shape[0], 8, 8)
        return x, position_ids.float().sum()


def test_one_sharded_input_losing_its_symbol_is_enough_to_refuse(group):
    compiled = cp_passes.cp_compile(ChunkedTokens(), mesh=group, backend="aot_eager", verbose=False)
    with pytest.raises(CPCompileError) as info:
        compiled(torch.randint(0, 32, (2, 8)), torch.arange(8)[None].expand(2, 8))
    assert "specialized the local sequence length of input 'ids' to 8" in str(info.value)
    assert "test_never_wrong.py" in str(info.value) and "reshape(ids.shape[0], 8, 8)" in str(info.value)


def test_a_seq_inputs_typo_names_the_input_and_suggests_the_name(group):
    spec = CPSpec(seq_inputs=("input_ids", "position_id"))
    compiled = cp_passes.cp_compile(toy(), spec, mesh=group, backend="aot_eager", verbose=False)
    with pytest.raises(ValueError) as info:
        compiled(input_ids=torch.randint(0, 32, (2, 8)), position_ids=torch.arange(8)[None].expand(2, 8))
    message = str(info.value)
    assert "input 'position_ids' (2, 8) has the local sequence length 8 on dim 1" in message
    assert "did you mean 'position_ids' for 'position_id'?" in message


def test_no_listed_sequence_input_suggests_the_name(group):
    compiled = cp_passes.cp_compile(toy(), CPSpec(seq_inputs=("input_id",)), mesh=group, backend="aot_eager",
                                    verbose=False)
    with pytest.raises(ValueError, match="found no sequence input.*did you mean 'input_ids' for 'input_id'"):
        compiled(input_ids=torch.randint(0, 32, (2, 8)))


class ImageFeatures(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.proj = nn.Embedding(32, 8), nn.Linear(8, 8)

    def forward(self, input_ids, image_features):
        return self.proj(self.embed(input_ids)) + image_features.mean()


def test_an_input_whose_size_equals_the_local_length_by_coincidence_is_not_sharded(group):
    """Image features [n_tokens, hidden] whose hidden size equals the local length: no known sequence input,
    not the tokens' batch dims. Without a spec they were sharded (each rank averaged 1/P of them); now the
    call and shard_batch say which fields settle it, and declared whole they are read whole."""
    ids, features = torch.randint(0, 32, (2, 8)), torch.randn(5, 8)
    compiled = cp_passes.cp_compile(ImageFeatures(), mesh=group, backend="aot_eager", verbose=False)
    why = r"input 'image_features' \(5, 8\) has the sequence length 8 on dim 1.*may be a coincidence.*replicated_inputs"
    with pytest.raises(ValueError, match=why):
        compiled(input_ids=ids, image_features=features)
    with pytest.raises(ValueError, match=why):
        cp_passes.shard_batch({"input_ids": torch.randint(0, 32, (2, 8)), "image_features": features}, group)
    spec = CPSpec(replicated_inputs=("image_features",))
    compiled = cp_passes.cp_compile(ImageFeatures(), spec, mesh=group, backend="aot_eager", verbose=False)
    compiled(input_ids=ids, image_features=features)  # the declaration settles it: no error


class SegmentAttention(nn.Module):
    """SDPA with a boolean mask from doc ids: same document, causal, within ``window``; doc id 0 is padding
    (the T5X convention), which hides every key of a one-document probe filled with doc id 0."""

    def __init__(self, window: int | None, zero_is_padding: bool):
        super().__init__()
        self.window, self.zero_is_padding = window, zero_is_padding
        self.embed, self.qkv = nn.Embedding(32, 8), nn.Linear(8, 24)

    def forward(self, input_ids, doc_ids):
        q, k, v = self.qkv(self.embed(input_ids))[:, None].chunk(3, -1)
        pos = torch.arange(input_ids.shape[1])
        mask = (doc_ids[:, :, None] == doc_ids[:, None, :]) & (pos[:, None] >= pos[None, :])
        if self.window:
            mask = mask & (pos[:, None] - pos[None, :] < self.window)
        if self.zero_is_padding:
            mask = mask & (doc_ids[:, None, :] != 0)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])


@pytest.mark.parametrize("window,zero_is_padding,transport,envelope", [
    (4, False, "halo", "window 4 read from the model's mask for one document"),
    (None, False, "sequence_gather", "causal envelope"),
    (4, True, "sequence_gather", "causal envelope")])
def test_a_doc_id_mask_plans_the_window_it_shows_for_one_document(group, window, zero_is_padding, transport,
                                                                   envelope):
    """The window of a mask read from doc ids is probed with one document; a mask that hides every key of that
    probe (doc id 0 as padding) shows no window and keeps the causal envelope (it read as window 0 once, and
    every valid run then failed the envelope check)."""
    compiled = cp_passes.cp_compile(SegmentAttention(window, zero_is_padding), mesh=group, backend="aot_eager",
                                    verbose=False)
    compiled(input_ids=torch.randint(0, 32, (2, 8)), doc_ids=torch.ones(2, 8, dtype=torch.long))
    (record,) = [r for r in compiled.compile_records[0].records if r.rule == "sdpa_data_mask"]
    assert record.transport == transport and envelope in record.note, (record.transport, record.note)


def test_the_llama_spec_shards_doc_ids_and_other_specs_must_list_them(group):
    ids, doc_ids = torch.randint(0, 32, (1, 8)), torch.zeros(1, 8, dtype=torch.long)
    compiled = cp_passes.cp_compile(toy(), "llama", mesh=group, backend="aot_eager", verbose=False)
    compiled(input_ids=ids, doc_ids=doc_ids)
    assert [r.rule for r in compiled.compile_records[0].records if r.rule.startswith("sdpa")] == ["sdpa_data_mask"] * 2
    spec = cp_passes.load_spec("llama").replace(seq_inputs=("input_ids",))
    compiled = cp_passes.cp_compile(toy(), spec, mesh=group, backend="aot_eager", verbose=False)
    with pytest.raises(ValueError, match=r"input 'doc_ids' \(1, 8\) has the local sequence length.*add it to "
                                         r"seq_inputs"):
        compiled(input_ids=ids, doc_ids=doc_ids)


@pytest.mark.parametrize("spec,what,closest", [
    (CPSpec(attention=(cp_passes.AttentionRule("layer.*.attn", window=4),)),
     "AttentionRule.modules='layer.*.attn'", "layers.0.attn"),
    (CPSpec(causal_convs=("layers.*.conv1d",)), "causal_convs entry 'layers.*.conv1d'", "layers.0.conv"),
])
def test_a_spec_glob_that_matches_no_module_names_the_closest_paths(group, spec, what, closest):
    from shared import toy_model

    with pytest.raises(ValueError) as info:
        cp_passes.cp_compile(toy_model(conv_kernel=3), spec, mesh=group, backend="aot_eager", verbose=False)
    assert f"{what} matches no module of the model; closest module paths: [" in str(info.value)
    assert closest in str(info.value)


class Experts(nn.Module):
    """A mixture of experts that loops over the experts nonzero() selects, or splits by data-dependent sizes."""

    def __init__(self, form: str):
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.form = form

    def forward(self, ids):
        x = self.embed(ids)
        choice = ids % 4
        out = torch.zeros_like(x)
        if self.form == "loop":
            for e in torch.nonzero(torch.bincount(choice.flatten(), minlength=4)).flatten():
                out = out + torch.where((choice == e)[..., None], self.experts[e](x), 0)
            return out
        sizes = torch.bincount(choice.flatten(), minlength=4)
        order = choice.flatten().argsort()
        parts = torch.split(x.flatten(0, 1)[order], sizes.tolist())
        return torch.cat([expert(p) for expert, p in zip(self.experts, parts)]).view_as(x)


@pytest.mark.parametrize("form", ["loop", "split"])
def test_data_dependent_code_is_a_compile_error_that_says_what_to_do(group, form):
    compiled = cp_passes.cp_compile(Experts(form), mesh=group, backend="aot_eager", verbose=False)
    with pytest.raises(CPCompileError) as info:
        compiled(torch.randint(0, 32, (2, 8)))
    message = str(info.value)
    assert "Fix:" in message and ("experts_implementation" in message or "outside the compiled module" in message)
    assert "test_never_wrong.py" in message, message


class ValidMask(nn.Module):
    """Attention masked by a boolean validity input, gathered as metadata."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.proj = nn.Linear(16, 16)

    def forward(self, ids, valid):
        x = self.embed(ids)[:, None]
        pos = torch.arange(ids.shape[1])
        mask = (pos[:, None] >= pos[None, :]) & valid[:, None, :, None] & valid[:, None, None, :]
        return self.proj(torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=mask)[:, 0])


@pytest.mark.full  # Inductor in the default run: test_parity's toy P = 2 case
def test_a_mask_from_a_boolean_input_lowers_with_inductor(group):
    """Inductor's CPU code generation asserted on the gathered bool buffer (CppCSEVariable, mask.dtype)."""
    compiled = cp_passes.cp_compile(ValidMask(), mesh=group, backend="inductor", verbose=False)
    out = compiled(torch.randint(0, 32, (2, 8)), torch.ones(2, 8, dtype=torch.bool))
    out.sum().backward()
    assert out.shape == (2, 8, 16)
    forward = compiled.compile_records[0].aot_ops["forward"]
    assert forward["cp_passes.prefix_gather.default"] == 1 and forward["cp_passes.metadata_gather.default"] == 1


def test_inside_an_outer_torch_compile_the_model_is_still_rewritten(group):
    """An outer torch.compile used to trace through the CP module (crashing on maybe_mark_dynamic, or tracing the
    plain model): the CP module's forward is opaque to dynamo and compiles its own graph."""
    compiled = cp_passes.cp_compile(toy(), mesh=group, backend="aot_eager", verbose=False)
    step = torch.compile(lambda ids: compiled(ids).sum(), backend="aot_eager")
    step(torch.randint(0, 32, (2, 8)))
    assert [r.rule for r in compiled.compile_records[0].records] == ["arange_positions", "sdpa_causal", "sdpa_causal"]


def test_a_forced_eager_run_fails_instead_of_running_unsharded(group):
    """torch.compiler.set_stance("force_eager") runs every compiled function eagerly, without an error."""
    compiled = cp_passes.cp_compile(toy(), mesh=group, backend="aot_eager", verbose=False)
    with torch.compiler.set_stance("force_eager"), pytest.raises(CPCompileError, match="without a compiled graph"):
        compiled(torch.randint(0, 32, (2, 8)))


def _gelu(x):
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def _gelu_grad(x, grad):
    t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
    return grad * (0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t))


class _Gelu(torch.autograd.Function):
    """A hand-written backward, as transformers' Bloom writes its GeLU (GeLUFunction in training)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return _gelu(x)

    @staticmethod
    def backward(ctx, grad):
        return _gelu_grad(ctx.saved_tensors[0], grad)


@torch.library.custom_op("cp_passes_tests::gelu", mutates_args=())
def _gelu_op(x: torch.Tensor) -> torch.Tensor:
    return _gelu(x)


_gelu_op.register_fake(torch.empty_like)
_gelu_op.register_autograd(lambda ctx, grad: _gelu_grad(ctx.saved_tensors[0], grad),
                           setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]))


class CustomBackward(nn.Module):
    def __init__(self, as_op: bool):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.proj, self.as_op = nn.Embedding(32, 8), nn.Linear(8, 8), as_op

    def forward(self, ids):
        x = self.embed(ids)
        return self.proj(torch.ops.cp_passes_tests.gelu(x) if self.as_op else _Gelu.apply(x)).pow(2).sum()


def test_a_custom_autograd_function_is_refused_since_its_backward_would_be_lost(group):
    """The pre-dispatch re-trace keeps an autograd.Function's forward only: the loss was exact and every gradient
    before the Function zero."""
    compiled = cp_passes.cp_compile(CustomBackward(as_op=False), mesh=group, backend="aot_eager", verbose=False)
    with pytest.raises(CPCompileError) as info:
        compiled(torch.randint(0, 32, (2, 8)))
    message = str(info.value)
    assert "custom torch.autograd.Function at tests/test_never_wrong.py" in message and "_Gelu.apply(x)" in message
    assert "torch.library.custom_op with register_autograd" in message


def test_the_custom_op_the_refusal_suggests_keeps_its_backward(group):
    """The fix the refusal names: a custom op with register_autograd, declared position-wise. Position-wise, this
    rank's gradients are the model's on this rank's tokens."""
    cp_passes.positionwise(torch.ops.cp_passes_tests.gelu.default)
    ids = torch.randint(0, 32, (2, 8))
    model, reference = CustomBackward(as_op=True), CustomBackward(as_op=True)
    cp_passes.cp_compile(model, mesh=group, backend="aot_eager", verbose=False)(ids).backward()
    reference(ids).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
