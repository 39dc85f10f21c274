"""The ZeRO-1 optimizer's sharded state survives state_dict()/load_state_dict(), and a
checkpoint from a different layout is refused with a message naming the mismatch."""

import pytest
import torch

from megatron_ul.model.chunks import model_dims
from megatron_ul.optim.distributed_optimizer import DistributedOptimizer
from megatron_ul.training.pretrain import configure, setup
from tests.distributed import run_distributed
from tests.training.equivalence import BASE, GPT2_STYLE


def round_trip(rank, world, argv):
    cfg = configure(argv, world)
    trainer = setup(cfg)
    trainer.train()
    saved = trainer.optimizer.state_dict()
    fresh = DistributedOptimizer(
        trainer.model, cfg.train, model_dims(trainer.model), max_bucket_elements=10**9
    )
    fresh.load_state_dict(saved)
    restored = fresh.state_dict()["optimizer"]["state"]
    same = all(
        torch.equal(saved["optimizer"]["state"][i][k], restored[i][k])
        for i in saved["optimizer"]["state"]
        for k in ("exp_avg", "exp_avg_sq")
    )
    bad = dict(saved, dp_cp_sp_size=saved["dp_cp_sp_size"] + 1)
    with pytest.raises(ValueError, match="dp_cp_sp_size"):
        fresh.load_state_dict(bad)
    return {
        "same": same,
        "pieces": len(saved["pieces"]),
        "shard": saved["shard"],
        "format": saved["format"],
    }


def test_state_dict_round_trip_and_layout_check():
    argv = (
        BASE
        + GPT2_STYLE
        + ["--use-distributed-optimizer", "--ds-sequence-parallel-size", "2", "--train-iters", "2"]
    )
    out = run_distributed(round_trip, 2, argv)
    assert all(r["same"] for r in out) and out[0]["format"] == "megatron_ul.zero1.v2"
    assert out[0]["shard"][0][1] == out[1]["shard"][0][0]  # the two shards tile the bucket
