import dataclasses

import pytest
import torch

import cp_passes
from cp_passes import CPSpec


def test_default_spec_serves_a_plain_causal_lm():
    spec = CPSpec()
    assert spec.seq_dim == 1 and spec.seq_inputs is None and spec.ignore_index == -100


def test_specs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        CPSpec().seq_dim = 2


@pytest.mark.parametrize("kwargs,shown", [
    ({"seq_dim": -1}, "-1"),
    ({"seq_dim": "1"}, "'1'"),
    ({"seq_inputs": "input_ids"}, "'input_ids'"),
    ({"seq_inputs": ("ids", "")}, "('ids', '')"),
    ({"ignore_index": 1.5}, "1.5"),
    ({"gather_kv_together": 1}, "1"),
    ({"name": ""}, "''"),
    ({"sequence_dims": {"position_ids": 2}}, "{'position_ids': 2}"),
    ({"sequence_dims": (("position_ids", "2"),)}, "(('position_ids', '2'),)"),
])
def test_invalid_specs_print_the_offending_value(kwargs, shown):
    with pytest.raises(ValueError) as info:
        CPSpec(**kwargs)
    field = next(iter(kwargs))
    assert f"CPSpec.{field}" in str(info.value) and shown in str(info.value)


def test_sequence_dims_place_one_input_s_sequence_counting_negative_dims_from_the_end():
    spec = CPSpec(sequence_dims=(("position_ids", -1),))
    mrope, flat = torch.zeros(3, 2, 8), torch.zeros(2, 8)
    assert spec.dim_of("position_ids", mrope) == 2 and spec.dim_of("position_ids", flat) == 1
    assert spec.dim_of("input_ids", mrope) == 1 and spec.batch_dims("position_ids", mrope) == (3, 2)
    assert spec.length_of("position_ids", mrope) == 8 and spec.length_of("position_ids", torch.zeros(())) is None
    assert spec.is_sharded("position_ids", mrope, 8, (2,))


def test_left_padding_pads_a_declared_window_only():
    assert cp_passes.AttentionRule("layers.*.attn", window=4, left_padding=2).left_padding == 2
    with pytest.raises(ValueError, match="left_padding=2 pads a window's halo"):
        cp_passes.AttentionRule("layers.*.attn", left_padding=2)
    with pytest.raises(ValueError, match="non-negative int, got -1"):
        cp_passes.AttentionRule("layers.*.attn", window=4, left_padding=-1)


def test_an_input_cannot_be_both_sharded_and_replicated():
    with pytest.raises(ValueError, match=r"\['mask'\].*seq_inputs=\('ids', 'mask'\).*replicated_inputs=\('mask',\)"):
        CPSpec(seq_inputs=("ids", "mask"), replicated_inputs=("mask",))


def test_load_spec_by_name_and_path(tmp_path):
    assert "llama" in cp_passes.available_specs()
    spec = cp_passes.load_spec("llama")
    assert spec.name == "llama" and "position_ids" in spec.seq_inputs
    path = tmp_path / "mine.py"
    path.write_text("from cp_passes import CPSpec\nSPEC = CPSpec(name='mine', seq_dim=2)\n")
    assert cp_passes.load_spec(str(path)) == CPSpec(name="mine", seq_dim=2)


def test_load_spec_errors_name_what_exists(tmp_path):
    with pytest.raises(ValueError, match="no spec named 'nope'.*llama"):
        cp_passes.load_spec("nope")
    path = tmp_path / "empty.py"
    path.write_text("X = 1\n")
    with pytest.raises(ValueError, match="no module-level SPEC"):
        cp_passes.load_spec(str(path))


def test_the_length_comes_from_token_inputs_first_and_never_from_a_replicated_input():
    import torch

    table, ids, mask = torch.zeros(4, 6), torch.zeros(2, 6, dtype=torch.long), torch.zeros(2, 6)
    spec = CPSpec()
    assert spec.length_input([("table", table), ("input_ids", ids)])[0] == "input_ids"
    assert spec.length_input([("table", table), ("mask", mask)])[0] == "table"
    replicated = CPSpec(replicated_inputs=("table",))
    assert replicated.length_input([("table", table), ("mask", mask)])[0] == "mask"
    # mask has the batch dims of the length input; without a spec, table (4 rows, not 2) is ambiguous
    assert not replicated.is_sharded("table", table, 6) and replicated.is_sharded("mask", mask, 6, (2,))
    with pytest.raises(ValueError, match="input 'table' .* may be a coincidence"):
        spec.is_sharded("table", table, 6, (2,))
    listed = CPSpec(seq_inputs=("mask",))
    assert listed.length_input([("input_ids", ids), ("mask", mask)])[0] == "mask"
    assert listed.length_input([("table", table)]) is None


def test_deepseek_v4_spec_reads_the_compression_rates_from_the_config():
    """Shards hold whole windows of every rate: their least common multiple, for the released rates 128."""
    from transformers import DeepseekV4Config

    def spec(**rates):
        config = DeepseekV4Config(compress_rates={"compressed_sparse_attention": rates["csa"],
                                                  "heavily_compressed_attention": rates["hca"]})
        return cp_passes.load_spec("deepseek_v4", config=config)

    assert (spec(csa=4, hca=128).pad_multiple, spec(csa=4, hca=128).packed_alignment) == (128, 128)
    assert spec(csa=8, hca=96).pad_multiple == 96 and spec(csa=2, hca=4).packed_alignment == 4
    assert cp_passes.load_spec("deepseek_v4").pad_multiple == 128  # the name alone: the released rates
