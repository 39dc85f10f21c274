"""The estimator's initialisation peak (what --dry-run prints): only the parameters a rank holds,
plus the generator's bounded workspace — so the 30B script (ZeRO-3 over 64 ranks) starts on
80 GB GPUs, where drawing every full weight (the old way) needed ~118 GB per GPU."""
from megatron_ul.config import ModelConfig
from megatron_ul.mpu.param_init import WORKSPACE_BYTES
from megatron_ul.training.memory_estimator import GiB, Layout, init_peak_bytes, stage_parameters

MODEL_30B = ModelConfig(num_layers=36, hidden_size=8192, num_attention_heads=64,
                        seq_length=131072, max_position_embeddings=131072,
                        position_embedding_type="rope", vocab_size=50257)


def test_init_peak_is_the_held_shard_plus_the_workspace():
    layout = Layout(sp=64)                     # the 30B script: SP 64, ZeRO-3 over dp_sp = 64
    params = stage_parameters(MODEL_30B, 1, 1)
    assert 29e9 < params < 30e9
    peak = init_peak_bytes(MODEL_30B, layout, zero_stage=3)
    assert peak == 4 * params / 64 + WORKSPACE_BYTES
    assert peak < 2 * GiB                      # fits an 80 GB GPU with room for training
    # Without ZeRO-3 every rank would hold its whole stage: the full 118 GB.
    assert init_peak_bytes(MODEL_30B, layout, zero_stage=1) > 100 * GiB
