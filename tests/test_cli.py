"""The commands README gives, run the way a user runs them."""

import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args, timeout=300, env=None):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_help_lists_every_option(capsys):
    """``python -m cp_passes --help`` as a user runs it; the subcommands' help from the same parser in-process."""
    from cp_passes.tools.cli import main

    top = run("-m", "cp_passes", "--help")
    assert top.returncode == 0 and "demo" in top.stdout and "explain" in top.stdout and "specs" in top.stdout
    options = {"demo": ("--nproc", "--steps", "--seq-len", "--backend", "--dump"),
               "explain": ("--world-size", "--seq-len", "--batch", "--rank", "--ranks", "--spec", "--dump",
                           "--wide", "llama-8b")}
    for command, wanted in options.items():
        with pytest.raises(SystemExit) as exit_:
            main([command, "--help"])
        assert exit_.value.code == 0
        out = capsys.readouterr().out
        assert all(option in out for option in wanted), out


def test_specs_lists_shipped_specs():
    out = run("-m", "cp_passes", "specs")
    assert out.returncode == 0
    names = [line.split(":")[0].split(" (")[0] for line in out.stdout.splitlines() if line and not line[0].isspace()]
    assert names[1:] == ["bamba", "bloom", "deepseek_v4", "falcon_h1", "falcon_mamba", "glm5_next", "granitemoehybrid",
                         "inkling2", "jamba", "kimi_linear", "llama", "mamba", "mamba2", "minimax", "nemotron_h",
                         "olmo_hybrid", "qwen3_next", "recurrent_gemma", "step5", "zamba2"]
    assert "\nstep5 (picked for model_type step3p7, step3p5):\n" in out.stdout
    assert "\n  pad_multiple = 128\n" in out.stdout
    kernel = "'transformers.models.bamba.modeling_bamba:mamba2_chunk_scan'"
    assert f"\n    - Recurrence\n        kernel = {kernel}\n" in out.stdout
    long = [line for line in out.stdout.splitlines() if len(line) > 100 and len(line.split()) > 1]
    assert not long, long  # a line over 100 holds one unbreakable token (a kernel's path)


def test_cpspec_help_documents_every_field():
    import pydoc

    import cp_passes

    text = pydoc.render_doc(cp_passes.CPSpec, renderer=pydoc.plaintext)
    for field in ("window_transport", "gathered_keys", "attention_keys", "layout", "experts"):
        assert f" {field} = " in text, field
    assert "How sliding-window attention gets its keys" in text


def test_demo_runs_and_matches_one_device(tmp_path):
    trace = tmp_path / "trace"
    out = run("-m", "cp_passes", "demo", "--backend", "aot_eager", "--steps", "2", "--seq-len", "63",
              "--dump", str(tmp_path), env={"TORCH_TRACE": str(trace)})
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2
    for line in steps:
        assert float(line.rsplit("rel diff", 1)[1]) <= 1e-4
    assert "rank 1 of 2, local length 32" in out.stdout and out.stdout.count("sdpa_causal") == 2
    index = (tmp_path / "rank1" / "graph0" / "index.txt").read_text().split()
    assert "explain.txt" in index and "aot_forward.py" in index and "aot_backward.py" in index
    after = next(name for name in index if "after_sequence_gather" in name)
    assert "prefix_finish" in (tmp_path / "rank1" / "graph0" / after).read_text()
    logs = "".join(p.read_text() for p in trace.iterdir())  # tlparse input: our artifacts are in it
    assert '"name": "cp_passes_explain"' in logs and "cp_passes_08_after_sequence_gather" in logs


@pytest.mark.full
def test_example_script_trains():
    out = run("examples/train_toy_llama.py", "--backend", "aot_eager", "--steps", "2", "--seq-len", "64")
    assert out.returncode == 0, out.stderr[-3000:]
    assert [line.split(":")[0] for line in out.stdout.splitlines() if line.startswith("step")] == ["step 0", "step 1"]
    # the logged loss is one device's (the ranks' shares added): about ln(256) = 5.55 at the start, not half of it
    first = float(next(line for line in out.stdout.splitlines() if line.startswith("step 0")).rsplit(" ", 1)[1])
    assert 5.0 < first < 6.5, out.stdout


@pytest.mark.full
def test_fsdp_example_trains_under_torchrun():
    """README's FSDP2 example as README runs it: torchrun, 4 CPU ranks as dp 2 x cp 2."""
    out = run("-m", "torch.distributed.run", "--nproc-per-node", "4", "examples/train_fsdp_cp.py",
              "--backend", "aot_eager", "--steps", "2", "--seq-len", "64", timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [line for line in out.stdout.splitlines() if line.startswith("step")]
    assert [line.split(":")[0] for line in steps] == ["step 0", "step 1"]
    assert all(math.isfinite(float(line.split("loss ")[1].split()[0])) for line in steps)


@pytest.mark.full  # the benchmarks' own figures: README; the transports' bytes: tests/test_halo.py
@pytest.mark.parametrize("layout,gathered", [("contiguous", 3), ("balanced", 9)])
def test_halo_benchmark_reports_the_lower_bound(layout, gathered):
    """The halo moves exactly the bound; a gather of the causal prefix several times more (contiguous: 4x on
    rank 1 to 28x on rank 7; balanced, whose bound is a halo per range: 10x to 14x)."""
    out = run("benchmarks/halo_bytes.py", "--seq-len", "32768", "--world-size", "8", "--layout", layout)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"layout {layout}" in out.stdout
    totals = out.stdout.split("rank    halo total MiB")[1].splitlines()[2:]
    assert [line.split()[0] for line in totals] == ["1", "4", "7"]
    for line in totals:
        rank, halo, gather, bound, halo_ratio, gather_ratio = line.split()
        assert float(halo_ratio) == 1.0 and float(gather_ratio) > gathered


@pytest.mark.full
def test_attention_bytes_benchmark_meets_the_causal_and_window_bounds():
    """Causal and windowed attention receive exactly the bound on every rank and layout; packed documents, whose
    boundaries are data, receive the causal envelope, which the last line's worst ratio shows."""
    out = run("benchmarks/attention_bytes.py", "--seq-len", "2048", "--world-sizes", "4", "--window", "64",
              "--docs", "4")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line.split() for line in out.stdout.splitlines() if line.startswith(("contiguous", "balanced"))]
    assert len(lines) == 2 * 3 * 4
    for layout, kind, world, rank, moved, bound, ratio, gathered in lines:
        assert kind == "packed" or (moved == bound and ratio == "1.000"), (layout, kind, rank, moved, bound)
    assert out.stdout.splitlines()[-1].startswith("worst bytes/bound: ")


def test_explain_plans_rank_3_and_dumps_its_graphs(tmp_path):
    out = run("-m", "cp_passes", "explain", "toy-llama", "--world-size", "8", "--seq-len", "4096", "--rank", "3",
              "--ranks", "0", "3", "7", "--dtype", "float32", "--dump", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "rank 3 of 8, local length 512" in text
    # K+V at kv_heads per position: 2 * batch 1 * 2 heads * 16 dims * 4 bytes = 256 B; 512 tokens per rank
    assert "layout: balanced (auto: every transport this spec can use supports it)" in text
    table = text.split("received / lower bound")[1]
    row = next(line for line in table.splitlines() if line.startswith("layers.1.attn"))
    # balanced: causal queries of rank r see 14 - r other chunks of 256 rows, and only those come
    assert row.split()[2:] == ["896.0", "KiB", "/", "896.0", "KiB", "704.0", "KiB", "/", "704.0", "KiB",
                               "448.0", "KiB", "/", "448.0", "KiB"]
    assert "parameters 417.2 KiB and their gradients 417.2 KiB" in text
    # what a training step of rank 3 keeps for the backward: about one device's divided by P, by module
    saved = re.search(r"saved for backward +([\d.]+) MiB; one device at 4096 tokens saves [\d.]+ MiB, / 8 = "
                      r"([\d.]+) MiB \(ratio ([\d.]+)\)", text)
    assert saved and float(saved[3]) <= 1.0, text
    assert re.search(r"\n    layers\.\*\.attn\.wo +[\d.]+ KiB in \d+ tensors", text)  # inside the repeated block
    # K+V of the 11 chunks of 0..12 of 16 (rank 3's causal prefix) that other ranks hold
    assert "largest collective buffer  704.0 KiB (_c10d_functional.all_to_all_single.default" in text, text
    assert "collectives overlapped with compute: 4.0 MiB of 4.0 MiB (100%)" in text, text
    assert "largest [sequence x sequence] tensor  0 B (none)" in text
    folder = tmp_path / "rank3" / "graph0"
    index = (folder / "index.txt").read_text().split()
    # the block is planned once, as a region, then the graph that calls it
    assert index[:4] == ["00_aten_pre_dispatch_captured_by_dynamo_on_fake_tensors.py",
                         "01_repeated_subgraph0_after_sequence_gather_1_rewrites.py",
                         "02_after_positions_1_rewrites.py", "03_after_shift_0_rewrites.py"]
    after = (folder / index[1]).read_text()
    assert after.count("# cp_passes: pass=sequence_gather rule=sdpa_causal") >= 5  # 5 nodes per attention
    assert "cp_passes: pass=positions rule=arange_positions" in (folder / index[2]).read_text()


def test_layers_alike_are_shown_once_with_their_count():
    """Three or more consecutive rows that differ only in their layer's index (and node name) become one; a gap
    in the indices, another column that differs, or a run of two keeps the rows."""
    from cp_passes.report.explain import collapse_layers

    rows = [(f"sdpa_{i}", "m.py:3", f"model.layers.{i}.self_attn", "sdpa_causal", "1 MiB") for i in range(61)]
    rows += [("sdpa_61", "m.py:3", "model.layers.61.self_attn", "sdpa_causal", "2 MiB"),
             ("loss", "m.py:9", "", "x", "")]
    assert collapse_layers(rows, 2) == [("sdpa_0", "m.py:3", "model.layers.0-60.self_attn x61", "sdpa_causal", "1 MiB"),
                                        *rows[61:]]
    gaps = [(f"n{i}", f"layers.{i}.attn", "r") for i in (0, 1, 3, 4, 5, 7, 8)]
    assert collapse_layers(gaps, 1) == [*gaps[:2], ("n3", "layers.3-5.attn x3", "r"), *gaps[5:]]


@pytest.mark.full  # a factory's model in a subprocess: test_explain_prints_a_refusal_as_its_problems by default
def test_explain_plans_your_model_from_a_factory_with_every_layer_traced():
    """A module:factory, every layer traced (--no-regions): one table row per layer (attention rows alternate with
    convolutions', so no run of alike rows is shown once)."""
    out = run("-m", "cp_passes", "explain", "tests.shared:mixed_toy", "--world-size", "4", "--seq-len", "64",
              "--packed", "--ranks", "0", "3", "--no-regions")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "cp_passes plan: tests.shared:mixed_toy (built by the factory)" in out.stdout
    assert "with each repeated block once" not in out.stderr
    for layer in range(4):
        assert re.search(rf"layers\.{layer}\.attn +sdpa_data_mask +halo", out.stdout), out.stdout
    assert "the model's mask from doc_ids" in out.stdout
    assert "collectives overlapped with compute: 0 B of" in out.stdout


def test_explain_plans_a_transformers_config(tmp_path):
    """A transformers config.json, each repeated block planned once; a factory that cannot be loaded is named."""
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, '
        '"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}')
    out = run("-m", "cp_passes", "explain", "--hf-config", str(tmp_path / "config.json"), "--world-size", "4",
              "--seq-len", "64")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "cp_passes plan: LlamaForCausalLM (transformers' LlamaForCausalLM, 3 layers" in out.stdout
    assert "planning LlamaForCausalLM with each repeated block once" in out.stderr
    assert re.search(r"model\.layers\.0-2\.self_attn x3 +sdpa_causal", out.stdout), out.stdout  # three alike: one row
    from cp_passes.tools.cli import main

    with pytest.raises(SystemExit, match="cannot load the model factory 'no_such_module:build'"):
        main(["explain", "no_such_module:build"])


def sorting_model():
    """The factory ``explain tests.test_cli:sorting_model`` plans: a sort along the sequence, which is refused,
    in a model whose building warns (as dynamo and transformers do while tracing)."""
    import warnings

    import torch

    warnings.warn("sorting_model is built", UserWarning)

    class Sorting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(32, 8)

        def forward(self, input_ids, labels=None):
            return torch.sort(self.embed(input_ids), dim=1).values.sum()

    return Sorting()


def test_explain_prints_a_refusal_as_its_problems():
    """A refused model's dry run ends with the refusal as cp_passes words it (the op, the line, why, the fix) and
    exit status 1: no traceback, no rank prefix, and the warnings raised on the way counted in one line."""
    out = run("-m", "cp_passes", "explain", "tests.test_cli:sorting_model", "--world-size", "8", "--seq-len", "64")
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "[rank" not in out.stderr, out.stderr
    assert "UserWarning" not in out.stderr and "cp_passes: 1 warning while tracing, hidden (the first, from " \
        "test_cli.py: sorting_model is built); python -W default shows them" in out.stderr, out.stderr
    assert "aten.sort.default at tests/test_cli.py" in out.stderr and "fix: " in out.stderr, out.stderr


def raising_model():
    """The factory ``explain tests.test_cli:raising_model`` plans: its forward raises, as a default config can (Step
    3.7's sliding layers without a sliding_window)."""
    import torch

    class Raising(torch.nn.Module):
        def forward(self, input_ids, labels=None):
            raise ValueError("this config cannot run")

    return Raising()


def test_explain_prints_a_failure_in_the_model_in_a_few_lines():
    """An exception from the model's own code is not a refusal: one message (the exception, the model's line) and
    exit status 2, no traceback, no rank prefix."""
    out = run("-m", "cp_passes", "explain", "tests.test_cli:raising_model", "--world-size", "8", "--seq-len", "64")
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "[rank" not in out.stderr, out.stderr
    assert "cp_passes explain: the dry run failed with " in out.stderr and "test_cli.py\", line" in out.stderr
    assert 'raise ValueError("this config cannot run")' in out.stderr, out.stderr


def test_hf_config_of_a_vision_language_model_builds_it_with_every_cache_off():
    """glm5_next has no causal LM class: --hf-config builds its image-text-to-text model (run on text alone), with
    the text model's cache off too (its layers would update conv states a training step never reads), and names
    the text model's depth."""
    from cp_passes.tools.cli import _explain_model, build_parser
    from cp_passes.tools.models import hf_model

    _, config, name = hf_model("glm5_next")
    assert name == "Glm5NextForConditionalGeneration"
    assert not getattr(config, "use_cache", False) and config.text_config.use_cache is False
    args = build_parser().parse_args(["explain", "--hf-config", "glm5_next"])
    description = _explain_model(args, None)[3]
    assert f"{config.text_config.num_hidden_layers} layers" in description, description
    with pytest.raises(SystemExit, match="neither a transformers model class"):
        hf_model("no_such_model_type")


def test_a_factory_returning_a_plain_transformers_model_plans_with_its_cache_off(fake_group):
    """``explain mymodels:model`` where ``model()`` returns a LlamaForCausalLM as transformers makes it (use_cache
    on): the dry run turns the cache off as a training step does, as --hf-config does, instead of failing on the
    DynamicCache in the outputs (with regions and memory: on a fake constant the cache path leaves in the block;
    measured by hand with explain)."""
    import torch

    from cp_passes.tools.dryrun import dry_run
    from cp_passes.tools.models import factory_model

    inputs = {"input_ids": ((1, 64), torch.long), "labels": ((1, 64), torch.long)}
    run = dry_run(factory_model("family_models:hf_llama"), inputs, mesh=fake_group)
    assert [r.rule for r in run.record.records].count("sdpa_causal") == 2


@pytest.mark.full  # the halo rows and bytes: test_halo_benchmark_reports_the_lower_bound by default
def test_explain_plans_halos_for_a_sliding_window_model():
    out = run("-m", "cp_passes", "explain", "toy-llama-swa", "--world-size", "64", "--seq-len", "1048576")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("sdpa_window") >= 2 and out.stdout.count("causal_conv_slice") >= 2
    assert "window 4096 read from the model's mask" in out.stdout
    # the window is attended tile by tile and the model's own band mask (and its SDPA) is gone from the graph
    assert "largest [sequence x sequence] tensor  0 B (none)" in out.stdout, out.stdout


def test_the_table_fits_a_terminal_and_names_the_model_s_code(fake_group):
    """explain in a terminal fits its width (format_record(record, width)); --wide, and output to a pipe, keep
    every column. A hand-written attention's notes name the model's source lines, not graph nodes."""
    import torch

    from cp_passes.report.explain import format_record
    from cp_passes.tools.dryrun import dry_run
    from cp_passes.tools.models import EXAMPLES, built_in

    inputs = {"input_ids": ((1, 64), torch.long), "labels": ((1, 64), torch.long)}
    record = dry_run(lambda: built_in(EXAMPLES["toy-llama-swa"][1]), inputs, mesh=fake_group).record
    for width in (80, 100, 120):
        lines = format_record(record, width).splitlines()
        assert max(len(line) for line in lines) <= width, "\n".join(lines)
    wide = format_record(record)
    assert "elements recv" in wide.splitlines()[2] and max(len(line) for line in wide.splitlines()) > 120

    def eager_llama():
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=128, use_cache=False)
        config._attn_implementation = "eager"
        return LlamaForCausalLM(config)

    notes = [r.note for r in dry_run(eager_llama, inputs, mesh=fake_group).record.records if r.rule == "key_operand"]
    assert len(notes) == 2 and all("at llama/modeling_llama.py:" in note for note in notes), notes
    assert notes[0].startswith("'") and "key_states" in notes[0].split("' at ")[0], notes
    assert not any(re.search(r"'[a-z_]+_\d+'", note) for note in notes), notes  # no graph node names ('add_3')


def test_explain_exports_a_model_that_casts_its_modules_and_constrains_its_length(fake_group):
    """The dry run without regions (``explain --no-regions``) builds the model as the regions path does (on the
    meta device, then fake tensors: a module cast in ``__init__``, as DeepSeek V4's norms are, cannot be built
    under a FakeTensorMode) and exports any length the model accepts (DeepSeek V4 refuses fewer than 256 tokens:
    a length ``Dim`` from 2 up fails the export)."""
    import torch
    import torch.nn.functional as F

    from cp_passes.tools.dryrun import dry_run

    class Guarded(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(64, 16)
            self.qkv = torch.nn.Linear(16, 48)
            self.norm = torch.nn.LayerNorm(16).to(torch.float64)

        def forward(self, input_ids):
            if input_ids.shape[1] < 8:
                raise ValueError("at least 8 tokens")
            q, k, v = self.qkv(self.embed(input_ids)).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
            return self.norm(out.double()).float().sum()

    record = dry_run(Guarded, {"input_ids": ((1, 32), torch.long)}, mesh=fake_group).record
    assert any("(causal prefix)" in r.collective for r in record.records), record.records


def test_a_model_that_constrains_its_length_and_leaves_its_inputs_apart_is_planned_through_dynamo(fake_group):
    """Exported with a length of their own (the model refuses a free one), two sharded inputs the model never
    combines take two symbols: the export path says so and names the way that works (dynamo ties the lengths)."""
    import pytest
    import torch

    from cp_passes.tools.dryrun import dry_run

    class Apart(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(64, 16)

        def forward(self, input_ids, labels):
            if input_ids.shape[1] < 8:
                raise ValueError("at least 8 tokens")
            return self.embed(input_ids).cumsum(1).sum() + labels.float().sum()

    inputs = {name: ((1, 32), torch.long) for name in ("input_ids", "labels")}
    with pytest.raises(ValueError, match=r"one symbolic length.*without --no-regions"):
        dry_run(Apart, inputs, mesh=fake_group)
    assert dry_run(Apart, inputs, mesh=fake_group, regions=True).record.records


def test_the_dry_run_freezes_the_heap_only_while_it_runs(monkeypatch):
    """The dry run leaves the garbage collector as it found it: the heap frozen only inside, a caller's own freeze
    untouched (neither frozen again nor thawed: the frozen count itself drifts as frozen objects die)."""
    import gc

    from cp_passes.tools.dryrun import _heap_frozen

    inside = _heap_frozen(gc.get_freeze_count)
    assert gc.get_freeze_count() == 0 and inside() > 0 and gc.get_freeze_count() == 0
    gc.freeze()
    try:
        calls = []
        with monkeypatch.context() as patched:
            patched.setattr(gc, "freeze", lambda: calls.append("freeze"))
            patched.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
            assert inside() > 0
        assert calls == [] and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_gpu_check_runs_on_cpu_as_a_smoke_test():
    """benchmarks/gpu_check.py at small sizes on CPU: every parity line (pair kinds with grouped-query heads, fp32
    and bf16, forward and backward) passes, the throughput ratio line is printed, and the memory step runs on a fake
    group. The figures that matter come from a GPU (README)."""
    out = run("benchmarks/gpu_check.py", "--device", "cpu", "--seq-len", "2048", "--heads", "4", "--kv-heads", "2",
              "--head-dim", "32", "--dim", "64", "--ffn", "128", "--vocab", "256", "--parity-len", "64")
    assert out.returncode == 0, out.stderr[-3000:]
    parity = [line for line in out.stdout.splitlines() if line.startswith("parity ")]
    assert len(parity) == 8 and all(line.endswith("PASS") for line in parity), parity
    ratio = [line for line in out.stdout.splitlines() if line.startswith("block/flash throughput: ")]
    assert len(ratio) == 1 and float(ratio[0].split(": ")[1]) > 0
    assert "memory: rank 7 of 8's 2-layer step ran" in out.stdout
