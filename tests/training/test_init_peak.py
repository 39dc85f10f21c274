"""The estimator's initialisation peak (what --dry-run prints): only the parameters a rank holds,
plus the generator's bounded workspace — so the 30B script (ZeRO-3 over 64 ranks) starts on
80 GB GPUs, where drawing every full weight would need ~118 GB per GPU."""

import os
import re

from megatron_ul.config import ModelConfig
from megatron_ul.mpu.param_init import WORKSPACE_BYTES
from megatron_ul.training.dry_run import describe
from megatron_ul.training.memory_estimator import GiB, Layout, init_peak_bytes, stage_parameters
from megatron_ul.training.pretrain import configure
from tests.scripts.test_launch_scripts import ROOT, script_arguments

MODEL_30B = ModelConfig(
    num_layers=36,
    hidden_size=8192,
    num_attention_heads=64,
    seq_length=131072,
    max_position_embeddings=131072,
    position_embedding_type="rope",
    vocab_size=50257,
)


def test_init_peak_is_the_held_shard_plus_the_workspace():
    layout = Layout(sp=64)  # the 30B script: SP 64, ZeRO-3 over dp_cp_sp = 64
    params = stage_parameters(MODEL_30B, 1, 1)
    assert 29e9 < params < 30e9
    peak = init_peak_bytes(MODEL_30B, layout, zero_stage=3)
    assert peak == 4 * params / 64 + WORKSPACE_BYTES
    assert peak < 2 * GiB  # fits an 80 GB GPU with room for training
    # Without ZeRO-3 every rank would hold its whole stage: the full 118 GB.
    assert init_peak_bytes(MODEL_30B, layout, zero_stage=1) > 100 * GiB


def test_the_30b_scripts_dry_run_reports_an_init_peak_that_fits_80_gb():
    script = os.path.join(ROOT, "scripts", "slurm", "pretrain_gpt_30B_128K.sbatch")
    world, argv = script_arguments(script)
    text = describe(configure(argv + ["--dry-run"], world_size=world))
    peak = float(re.search(r"initialisation peak per GPU: ([\d.]+) GiB", text).group(1))
    assert 0 < peak < 2  # ~1.75 GiB: 29.4 B fp32 parameters / 64 ZeRO-3 shards + workspace
