"""Layout conversion: tensor-parallel shards merged and cut again for another TP/PP/VP layout,
and ZeRO-sharded state in the layout-independent form."""
