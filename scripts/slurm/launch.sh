# Sourced by the sbatch scripts after they set NNODES, GPUS_PER_NODE and PRETRAIN_ARGS.
# One srun task per node, each starting torchrun for its GPUs; c10d rendezvous on the first
# node of the allocation.
print_args_or_continue "$((NNODES * GPUS_PER_NODE))" "${PRETRAIN_ARGS[@]}"

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
MASTER_PORT=${MASTER_PORT:-29500}

# Megatron's requirement for overlapping TP/SP communication with compute correctly.
export CUDA_DEVICE_MAX_CONNECTIONS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
# Fail fast instead of hanging when one rank dies inside a collective.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
# NCCL: InfiniBand on (the Ulysses all-to-all crosses nodes when SP > GPUs per node).
export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}
# Pin the bootstrap/socket interface if the default route is not the fabric, e.g.:
#   export NCCL_SOCKET_IFNAME=ib0        (or eth0, bond0, ^docker,lo)
#   export NCCL_IB_HCA=mlx5              (restrict to the IB adapters)
#   export NCCL_DEBUG=INFO               (print the chosen transports once)

srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
    torchrun --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-id "${SLURM_JOB_ID}" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \
    pretrain_gpt.py "${PRETRAIN_ARGS[@]}"
