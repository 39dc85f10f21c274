#!/usr/bin/env python
"""Convert a checkpoint: between megatron_ul layouts, and between megatron_ul, Hugging Face,
Megatron-LM and megatron-core (in the style of Megatron-LM's tools/checkpoint/convert.py).

    python -m tools.checkpoint.convert --load-dir A --save-dir B \
        --target-tensor-parallel-size 1 --target-pipeline-parallel-size 1 [--no-optim] \
        [--target-num-layers-per-virtual-pipeline-stage N]
    python -m tools.checkpoint.convert --from hf --to megatron_ul --load-dir HF --save-dir B \
        [--target-tensor-parallel-size T] [--target-pipeline-parallel-size P]
    python -m tools.checkpoint.convert --from megatron_ul --to megatron_core --load-dir A \
        --save-dir MEGATRON [--ckpt-format torch_dist|torch] [--transformer-impl local]

--from / --to name the formats (default megatron_ul both): megatron_ul, hf, megatron_lm (legacy
Megatron-LM / Megatron-DeepSpeed), megatron_core; any pair converts through the layout-free
form (one iteration merged to TP1/PP1). Between megatron_ul layouts, TP shards are merged by
each parameter's partition dim/stride (recorded in metadata.json) and re-split; pipeline
stages (interleaved model chunks included) are re-cut by global layer name; optimizer moments
follow their parameters (the last stage's tied embedding copy gets the first stage's table and
moments). SP and DP targets only change metadata (parameters and plain optimizer state are
replicated over them). To or from another framework only the weights travel. The source is
never modified and an existing iteration in B is never replaced. RNG states are not carried
over: the new layout's streams start from --seed. A line per tensor group read and written
goes to stderr.
"""

import sys

try:
    import megatron_ul  # noqa: F401
except ModuleNotFoundError:  # `python tools/NAME.py` from a checkout without the install
    sys.exit("megatron_ul is not installed: run `bash scripts/install.sh` (or pip install -e .)")

from megatron_ul.checkpoint.interop import cli


def main(argv=None) -> int:
    return cli.main(argv, __doc__.split("\n\n")[0])


if __name__ == "__main__":
    sys.exit(main())
