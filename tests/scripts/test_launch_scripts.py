"""Every launch script's pretrain_gpt.py arguments pass configuration validation and --dry-run
at the script's own world size, so the scripts cannot rot."""
import glob
import os
import subprocess

import pytest

from megatron_ul.training.dry_run import describe
from megatron_ul.training.pretrain import configure

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "scripts", "*.sh"))
                 + glob.glob(os.path.join(ROOT, "scripts", "slurm", "*.sbatch")))
# Helpers and the install/test/lint wrappers launch no training.
SCRIPTS = [s for s in SCRIPTS
           if os.path.basename(s) not in ("common.sh", "install.sh", "test.sh", "lint.sh")]


def script_arguments(path: str) -> tuple[int, list[str]]:
    env = dict(os.environ, PRINT_ARGS_ONLY="1")
    for name in ("DATA_PATH", "SLURM_NNODES", "SP", "TP", "SEQ_LENGTH", "NPROC"):
        env.pop(name, None)
    out = subprocess.run(["bash", path], env=env, capture_output=True, text=True, timeout=30,
                         check=True).stdout.splitlines()
    return int(out[0]), out[1:]


def test_every_expected_script_exists():
    names = {os.path.basename(s) for s in SCRIPTS}
    assert {"pretrain_gpt_single_node.sh", "demo_cpu.sh", "pretrain_gpt_1.2B_1M.sbatch",
            "pretrain_gpt_7B_128K.sbatch", "pretrain_gpt_30B_128K.sbatch"} <= names


@pytest.mark.parametrize("path", SCRIPTS, ids=os.path.basename)
def test_script_arguments_pass_dry_run(path):
    world, argv = script_arguments(path)
    if os.path.basename(path) == "demo_cpu.sh":  # its data is built by the script itself
        data = argv.index("--data-path")
        argv[data:data + 6] = ["--mock-data", "--vocab-size", "2000"]
    cfg = configure(argv + ["--dry-run"], world_size=world)
    assert cfg.parallel.world_size == world
    text = describe(cfg)
    assert f"world {world} =" in text and "memory estimate per GPU" in text


def test_dry_run_prints_layout_and_exits_without_distributed(capsys):
    import torch.distributed as dist
    from megatron_ul.training.pretrain import main
    code = main(["--dry-run", "--world-size", "8", "--mock-data", "--vocab-size", "1000",
                 "--num-attention-heads", "8", "--tensor-model-parallel-size", "2",
                 "--ds-sequence-parallel-size", "2", "--seq-length", "256"])
    out = capsys.readouterr().out
    assert code == 0 and not dist.is_initialized()
    assert "world 8 = TP 2 × SP 2 × PP 1 × DP 2" in out
    assert "padded vocab 1024" in out and "memory estimate per GPU" in out


def test_dry_run_reports_config_errors(capsys):
    from megatron_ul.training.pretrain import main
    code = main(["--dry-run", "--world-size", "4", "--mock-data", "--vocab-size", "1000",
                 "--num-attention-heads", "6", "--ds-sequence-parallel-size", "4"])
    assert code == 2 and "not divisible" in capsys.readouterr().err
