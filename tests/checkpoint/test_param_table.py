"""The parameter-metadata table (pipeline/param_table.py): what the live layers of every rank
record in a checkpoint equals the table built from the model config on the meta device, in
several layouts; it survives save -> convert -> load -> save unchanged, and so do the tensors
(parameters and Adam moments)."""

from megatron_ul.config import ModelConfig
from megatron_ul.mpu.param_spec import FUSED_GATE_UP, FUSED_QKV
from megatron_ul.pipeline.param_table import parameter_table
from tests.checkpoint.runs import TINY
from tests.checkpoint.table_runs import round_trips
from tests.distributed import run_distributed

LLAMA = [
    "--position-embedding-type",
    "rope",
    "--swiglu",
    "--normalization",
    "RMSNorm",
    "--untie-embeddings-and-output-weights",
    "--group-query-attention",
    "--num-query-groups",
    "4",
    "--num-attention-heads",
    "8",
    "--disable-bias-linear",
]
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
PP2_INTERLEAVED = [
    "--pipeline-model-parallel-size",
    "2",
    "--num-layers-per-virtual-pipeline-stage",
    "1",
]
TP4 = ["--tensor-model-parallel-size", "4"]

CASES = {  # model, source layout, target layout (world 4)
    "gpt2-TP2PP2-to-PP2-interleaved": ([], TP2_PP2, PP2_INTERLEAVED),
    "llama-PP2-interleaved-to-TP4": (LLAMA, PP2_INTERLEAVED, TP4),
    "llama-TP4-to-TP2PP2": (LLAMA, TP4, TP2_PP2),
}


def test_table_round_trips_through_save_convert_load(tmp_path):
    argv = TINY + ["--train-iters", "1", "--lr-warmup-iters", "0", "--num-layers", "4"]
    out = run_distributed(round_trips, 4, argv, CASES, str(tmp_path))[0]
    for case, result in out.items():
        print(case, result)
        assert result == {"saved": True, "converted": True, "loaded": True, "tensors": True}, case


def test_table_carries_the_layers_rules():
    m = ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        swiglu=True,
        vocab_size=100,
        make_vocab_size_divisible_by=16,
        max_position_embeddings=16,
        untie_embeddings_and_output_weights=True,
    )
    t = parameter_table(m, tp=2)
    assert t["word_embeddings.weight"]["shape"] == [128, 32]  # 100 padded to 16·TP2
    assert (
        t["output_layer.weight"]["vocab_padded"] and t["output_layer.weight"]["partition_dim"] == 0
    )
    assert t["layers.0.attention.qkv.weight"]["fused"] == FUSED_QKV
    assert t["layers.1.mlp.fc1.weight"]["fused"] == FUSED_GATE_UP
    assert t["layers.1.mlp.fc1.weight"]["partition_stride"] == 2
    assert t["layers.0.attention.proj.weight"]["partition_dim"] == 1
    assert t["layers.0.input_norm.weight"]["partition_dim"] is None
