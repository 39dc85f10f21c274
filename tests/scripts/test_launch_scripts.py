"""Every launch script's pretrain_gpt.py arguments pass configuration validation and --dry-run
at the script's own world size, so the scripts cannot rot; every training script checkpoints
and resumes by default, and the sbatch scripts ask Slurm for a time-limit warning and requeue.
(The scripts run for real on a Slurm cluster in tests/slurm.)"""

import glob
import os
import re
import stat
import subprocess

import pytest

from megatron_ul.training.dry_run import describe
from megatron_ul.training.pretrain import configure

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = sorted(
    glob.glob(os.path.join(ROOT, "scripts", "*.sh"))
    + glob.glob(os.path.join(ROOT, "scripts", "slurm", "*.sbatch"))
)
# Helpers, the install/test/lint wrappers and data preprocessing (tests/data covers
# preprocess_array.sbatch) launch no training.
SCRIPTS = [
    s
    for s in SCRIPTS
    if os.path.basename(s)
    not in (
        "common.sh",
        "install.sh",
        "test.sh",
        "lint.sh",
        "test_torch_floor.sh",
        "preprocess_array.sbatch",
    )
]
SBATCH = [s for s in SCRIPTS if s.endswith(".sbatch")]
# The runs that must survive a restart (the demo is a fixed 2-minute showcase).
TRAINING = [s for s in SCRIPTS if os.path.basename(s) != "demo_cpu.sh"]
# Every variable the scripts read, unset so that the scripts' own defaults are tested.
SCRIPT_ENV = (
    "DATA_PATH",
    "TOKENIZER_TYPE",
    "SLURM_NNODES",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_JOB_ID",
    "SLURM_JOB_NAME",
    "GPUS_PER_NODE",
    "SP",
    "TP",
    "SEQ_LENGTH",
    "NPROC",
    "NUM_LAYERS",
    "HIDDEN_SIZE",
    "NUM_HEADS",
    "MICRO_BATCH",
    "GLOBAL_BATCH",
    "TRAIN_ITERS",
    "PRECISION",
    "RUN_NAME",
    "RUN_DIR",
    "CHECKPOINT_DIR",
    "TENSORBOARD_DIR",
    "SAVE_INTERVAL",
    "EXIT_DURATION_IN_MINS",
    "EXIT_MARGIN_MINS",
    "CKPT_FORMAT",
    "ASYNC_SAVE",
)


def script_arguments(path: str, **env_overrides) -> tuple[int, list[str]]:
    env = dict(os.environ, PRINT_ARGS_ONLY="1")
    for name in SCRIPT_ENV:
        env.pop(name, None)
    env.update(env_overrides)
    out = subprocess.run(
        ["bash", path], env=env, capture_output=True, text=True, timeout=30, check=True
    ).stdout.splitlines()
    return int(out[0]), out[1:]


def flag(argv: list[str], name: str):
    """The value of the last `name` in argv (argparse: the last one wins), None if absent."""
    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == name]
    return values[-1] if values else None


def test_every_expected_script_exists():
    names = {os.path.basename(s) for s in SCRIPTS}
    assert {
        "pretrain_gpt_single_node.sh",
        "demo_cpu.sh",
        "pretrain_gpt_1.2B_1M.sbatch",
        "pretrain_gpt_7B_128K.sbatch",
        "pretrain_gpt_30B_128K.sbatch",
    } <= names


@pytest.mark.parametrize("path", SCRIPTS, ids=os.path.basename)
def test_script_arguments_pass_dry_run(path):
    world, argv = script_arguments(path)
    if os.path.basename(path) == "demo_cpu.sh":  # its data is built by the script itself
        data = argv.index("--data-path")
        argv[data : data + 6] = ["--mock-data", "--vocab-size", "2000"]
    cfg = configure(argv + ["--dry-run"], world_size=world)
    assert cfg.parallel.world_size == world
    text = describe(cfg)
    assert f"world {world} =" in text and "memory estimate per GPU" in text


def test_dry_run_prints_layout_and_exits_without_distributed(capsys):
    import torch.distributed as dist

    from megatron_ul.training.pretrain import main

    code = main(
        [
            "--dry-run",
            "--world-size",
            "8",
            "--mock-data",
            "--vocab-size",
            "1000",
            "--num-attention-heads",
            "8",
            "--tensor-model-parallel-size",
            "2",
            "--ds-sequence-parallel-size",
            "2",
            "--seq-length",
            "256",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and not dist.is_initialized()
    assert "world 8 = TP 2 × SP 2 × PP 1 × DP 2" in out
    assert "padded vocab 1024" in out and "memory estimate per GPU" in out


def test_dry_run_reports_config_errors(capsys):
    from megatron_ul.training.pretrain import main

    code = main(
        [
            "--dry-run",
            "--world-size",
            "4",
            "--mock-data",
            "--vocab-size",
            "1000",
            "--num-attention-heads",
            "6",
            "--ds-sequence-parallel-size",
            "4",
        ]
    )
    assert code == 2 and "not divisible" in capsys.readouterr().err


@pytest.mark.parametrize("path", TRAINING, ids=os.path.basename)
def test_script_checkpoints_and_resumes_by_default(path):
    _, argv = script_arguments(path)
    name = os.path.basename(path)
    save, load = flag(argv, "--save"), flag(argv, "--load")
    assert save and save == load, f"{name}: --save and --load must name one directory"
    assert os.path.isabs(save) and f"{os.sep}runs{os.sep}" in save
    assert int(flag(argv, "--save-interval")) > 0 and flag(argv, "--tensorboard-dir")
    assert "--exit-signal-handler" in argv
    assert flag(argv, "--exit-duration-in-mins") is None  # outside Slurm: no time limit
    # CHECKPOINT_DIR and SAVE_INTERVAL move them; the script's own flags come before the extras
    _, argv = script_arguments(path, CHECKPOINT_DIR="/ckpt", SAVE_INTERVAL="7")
    assert flag(argv, "--save") == flag(argv, "--load") == "/ckpt"
    assert flag(argv, "--save-interval") == "7"


@pytest.mark.parametrize("path", TRAINING, ids=os.path.basename)
def test_script_saves_torch_dist_by_default(path):
    """Sharded checkpoints (every rank writes its own pieces) unless CKPT_FORMAT=torch;
    --async-save only with ASYNC_SAVE=1; the arguments pass validation either way."""
    world, argv = script_arguments(path)
    assert flag(argv, "--ckpt-format") == "torch_dist" and "--async-save" not in argv
    world, argv = script_arguments(path, ASYNC_SAVE="1")
    assert "--async-save" in argv
    configure(argv + ["--dry-run"], world_size=world)
    world, argv = script_arguments(path, CKPT_FORMAT="torch")
    assert flag(argv, "--ckpt-format") == "torch" and "--async-save" not in argv
    configure(argv + ["--dry-run"], world_size=world)


@pytest.mark.parametrize("path", SBATCH, ids=os.path.basename)
def test_sbatch_asks_for_a_time_limit_warning_and_requeue(path):
    directives = re.findall(r"^#SBATCH (\S+)", open(path).read(), re.M)
    assert "--requeue" in directives and "--open-mode=append" in directives
    signal = [d for d in directives if d.startswith("--signal=")]
    assert signal and re.fullmatch(r"--signal=USR1@\d+", signal[0]), signal
    assert "--ntasks-per-node=8" in directives and "--gpus-per-node=8" in directives


def fake_squeue(tmp_path, time_left: str) -> dict:
    """A PATH with an `squeue` that prints `time_left` for -o %L (as Slurm's does)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    squeue = bin_dir / "squeue"
    squeue.write_text(f"#!/bin/sh\necho '{time_left}'\n")
    squeue.chmod(squeue.stat().st_mode | stat.S_IXUSR)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "42"}


@pytest.mark.parametrize(
    "time_left, minutes",
    [
        ("1-00:00:00", "1430.00"),  # a day: stop 10 minutes before the limit
        ("2:00:00", "110.00"),
        ("30:00", "20.00"),
        ("12:00", "6.00"),  # shorter than twice the margin: half the time left
        ("0:30", "0.25"),
        ("UNLIMITED", None),
        ("NOT_SET", None),
    ],
)
def test_exit_duration_follows_the_jobs_time_left(tmp_path, time_left, minutes):
    path = os.path.join(ROOT, "scripts", "slurm", "pretrain_gpt_7B_128K.sbatch")
    _, argv = script_arguments(path, **fake_squeue(tmp_path, time_left))
    assert flag(argv, "--exit-duration-in-mins") == minutes
    _, argv = script_arguments(path, EXIT_MARGIN_MINS="30", **fake_squeue(tmp_path, time_left))
    if minutes == "1430.00":
        assert flag(argv, "--exit-duration-in-mins") == "1410.00"
    _, argv = script_arguments(
        path, EXIT_DURATION_IN_MINS="none", **fake_squeue(tmp_path, time_left)
    )
    assert flag(argv, "--exit-duration-in-mins") is None


@pytest.mark.parametrize("path", SCRIPTS, ids=os.path.basename)
def test_script_turns_on_no_per_collective_host_sync(path):
    """--timing-log-level times with CUDA events; what would sync the host per timed call or per
    collective (--timing-device-sync, blocking NCCL waits, blocking launches) stays off."""
    _, argv = script_arguments(path)
    assert "--timing-device-sync" not in argv
    for script in glob.glob(os.path.join(ROOT, "scripts", "**", "*"), recursive=True):
        if not os.path.isfile(script):
            continue
        text = open(script).read()
        for setting in ("CUDA_LAUNCH_BLOCKING=1", "NCCL_BLOCKING_WAIT=1", "--timing-device-sync"):
            assert setting not in text, f"{script} sets {setting}"
