"""tools/gpu_check.py's reduced CPU mode runs every check and table of the GPU check, with the
strict flash_attn stand-in in place of the real kernel (so the flash-attn row runs too)."""
import os
import subprocess
import sys

from megatron_ul.model.attention import FLASH_ON_CPU_ENV
from tests.conftest import ROOT, STAND_INS


def test_gpu_check_cpu_mode_passes_and_reports():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([STAND_INS, ROOT]),
               **{FLASH_ON_CPU_ENV: "1"}, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--cpu"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    for check in ("bf16, torch SDPA flash kernel vs fp32", "bf16, flash-attn 2 vs fp32",
                  "fp16 + dynamic loss scaling vs fp32", "fp16 overflow",
                  "fused AdamW vs foreach AdamW"):
        row = next(line for line in text.splitlines() if line.startswith(f"| {check}"))
        assert "| pass |" in row, row
    assert "flash_attn_func calls" in text and "FAIL" not in text
    # speed table: the fixed lengths and the longest-sequence search, with the estimate beside
    assert "| 32 | none |" in text and "| 64 | none |" in text and "| 128 | full |" in text
    assert "estimator GiB" in text
    # issue 14: initialisation time/memory and step time, eager vs --fused-layers
    assert "| eager layers |" in text and "| --fused-layers |" in text and "init peak GiB" in text
