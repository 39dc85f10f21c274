"""Module-level functions run on spawned gloo ranks by the ZeRO / fp16 checkpoint tests."""

from __future__ import annotations

import os

from megatron_ul.checkpoint import files
from megatron_ul.training.pretrain import configure, setup
from tests.checkpoint.runs import _on_rank0, convert_cli, train, train_then_resume

ZERO1 = ["--use-distributed-optimizer"]
ZERO2 = ["--zero-stage", "2"]
ZERO3 = ["--zero-stage", "3"]
SP2 = ["--ds-sequence-parallel-size", "2"]
TP2_SP2 = ["--tensor-model-parallel-size", "2", "--ds-sequence-parallel-size", "2"]


def zero_across_layouts(rank: int, world: int, argv: list[str], tmp: str) -> dict:
    """World 4, dropout off. Train ZeRO-1 on SP2·DP2 (dp_cp_sp 4) for 6 iterations, saving at 2 and
    4, then continue from its checkpoints on other layouts and optimizers:
      zero1_tp2_sp2_convert: convert.py to TP2, resume with ZeRO-1 on TP2·SP2 (dp_cp_sp 2);
      zero3_tp2_sp2_on_load: ZeRO-3 on TP2·SP2, resharded on load;
      zero2_tp2_sp2_on_load: ZeRO-2 on TP2·SP2, resharded on load;
      plain_sp2_dp2: plain AdamW from iteration 2, saving at 4 — then
      zero1_from_plain_tp2_sp2: ZeRO-1 on TP2·SP2 from that plain checkpoint's iteration 4;
      zero2_from_plain_sp2_dp2: ZeRO-2 on SP2·DP2 from the same.
    The LR schedule is fixed by --lr-decay-iters 6 so that runs stopping at 4 follow it too.
    Returns each run's losses."""
    src, tp2, plain = (os.path.join(tmp, n) for n in ("zero1", "zero1_tp2", "plain"))

    def run(flags, iters):
        return train(
            rank, world, argv + ["--lr-decay-iters", "6", "--train-iters", str(iters)] + flags
        )

    out = {"original": run(ZERO1 + SP2 + ["--save", src, "--save-interval", "2"], 6)}

    def convert_to_tp2():
        files.write_tracker(src, 2)
        assert (
            convert_cli(
                ["--load-dir", src, "--save-dir", tp2, "--target-tensor-parallel-size", "2"]
            )
            == 0
        )

    _on_rank0(convert_to_tp2)
    out["zero1_tp2_sp2_convert"] = run(ZERO1 + TP2_SP2 + ["--load", tp2], 4)
    out["zero3_tp2_sp2_on_load"] = run(ZERO3 + TP2_SP2 + ["--load", src], 4)
    out["zero2_tp2_sp2_on_load"] = run(ZERO2 + TP2_SP2 + ["--load", src], 4)
    out["plain_sp2_dp2"] = run(SP2 + ["--load", src, "--save", plain, "--save-interval", "2"], 4)
    out["zero1_from_plain_tp2_sp2"] = run(ZERO1 + TP2_SP2 + ["--load", plain], 6)
    out["zero2_from_plain_sp2_dp2"] = run(ZERO2 + SP2 + ["--load", plain], 6)
    return out


def fp16_resume(rank: int, world: int, argv: list[str], save_dir: str) -> dict:
    """Exact resume under --fp16 with ZeRO-1; also the scaler state saved and restored."""
    full, resumed = train_then_resume(rank, world, argv, save_dir, 2, 4)
    saved = files.load_torch(files.model_file(os.path.join(save_dir, "iter_0000002"), 0, 0, 1), "")[
        "grad_scaler"
    ]
    trainer = setup(configure(argv + ["--train-iters", "4", "--load", save_dir], world))
    restored = trainer.grad_scaler.state_dict()
    return {"full": full, "resumed": resumed, "saved": saved, "restored": restored}
