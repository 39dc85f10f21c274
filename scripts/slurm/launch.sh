# Sourced by the sbatch scripts after they set NNODES, GPUS_PER_NODE and PRETRAIN_ARGS (which
# hold run_args' checkpoint, TensorBoard and time-limit flags, see scripts/common.sh).
#
# srun starts the training processes itself, GPUS_PER_NODE tasks per node, without torchrun:
# every signal Slurm sends to the job step reaches the ranks directly, and no launcher in
# between kills them mid-save (torchrun SIGKILLs its workers 30 s after its own SIGTERM and
# exits 1). The ranks read SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID and MASTER_ADDR/PORT.
#
# Signals (docs/operations.md, "Time limits, preemption and requeue"):
#   #SBATCH --signal=USR1@T  the ranks (not this shell) get SIGUSR1 T s (up to 60 s more) before
#                            the time limit: they save at the end of the iteration and exit 0;
#                            this shell then requeues the job, which resumes from that save.
#   preemption, scontrol requeue, scancel, the time limit itself: SIGTERM to the ranks, srun
#                            and this shell, then SIGKILL after GraceTime (preemption) or
#                            KillWait: the ranks save likewise; Slurm requeues a preempted job.
#   --exit-duration-in-mins  the ranks stop by themselves before the limit (scripts/common.sh).
print_args_or_continue "$((NNODES * GPUS_PER_NODE))" "${PRETRAIN_ARGS[@]}"

first_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
# The address Slurm itself reaches the first node at (its NodeAddr; the hostname on most
# clusters). Rank 0 runs there and serves the rendezvous store.
MASTER_ADDR=${MASTER_ADDR:-$(scontrol show node "$first_node" -o \
                             | sed -n 's/.* NodeAddr=\([^ ]*\).*/\1/p')}
MASTER_ADDR=${MASTER_ADDR:-$first_node}
# One port per job: two jobs sharing a node do not collide, a requeued job reuses its own.
MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
export MASTER_ADDR MASTER_PORT

CPUS_PER_TASK=$(( ${SLURM_CPUS_ON_NODE:-$GPUS_PER_NODE} / GPUS_PER_NODE ))
CPUS_PER_TASK=$(( CPUS_PER_TASK > 0 ? CPUS_PER_TASK : 1 ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$CPUS_PER_TASK}
# Megatron's requirement for overlapping TP/SP communication with compute correctly.
export CUDA_DEVICE_MAX_CONNECTIONS=1
# Fail fast instead of hanging when one rank dies inside a collective.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
# NCCL: InfiniBand on (the Ulysses all-to-all crosses nodes when SP > GPUs per node).
export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}
# Pin the bootstrap/socket interface if the default route is not the fabric, e.g.:
#   export NCCL_SOCKET_IFNAME=ib0        (or eth0, bond0, ^docker,lo)
#   export NCCL_IB_HCA=mlx5              (restrict to the IB adapters)
#   export NCCL_DEBUG=INFO               (print the chosen transports once)

# The last --train-iters wins, as in pretrain_gpt.py's parser.
train_iters=
for ((i = 0; i < ${#PRETRAIN_ARGS[@]} - 1; i++)); do
    [[ "${PRETRAIN_ARGS[i]}" == --train-iters ]] && train_iters=${PRETRAIN_ARGS[i + 1]}
done
latest_iteration() {
    cat "$CHECKPOINT_DIR/latest_checkpointed_iteration.txt" 2>/dev/null || echo 0
}

# Everything of a run in one place: this job's log beside its checkpoints and TensorBoard.
mkdir -p "$RUN_DIR/logs"
job_log=$(scontrol show job "$SLURM_JOB_ID" -o | sed -n 's/.* StdOut=\([^ ]*\).*/\1/p')
[[ -n "$job_log" ]] && ln -sf "$job_log" "$RUN_DIR/logs/$SLURM_JOB_ID.out"
echo "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST:" \
     "$NNODES nodes x $GPUS_PER_NODE ranks; checkpoints in $CHECKPOINT_DIR" \
     "(latest complete iteration: $(latest_iteration)); $(date -u +%FT%TZ)"

# This shell is signalled only when Slurm ends the whole job (preemption, scontrol requeue,
# scancel, the time limit): remember it and keep waiting while the ranks save.
started_at=$(latest_iteration)
ended_by_slurm=
trap 'ended_by_slurm=1; echo "batch script: SIGTERM from Slurm, waiting for the ranks to save"' TERM
srun --kill-on-bad-exit=1 --ntasks-per-node="$GPUS_PER_NODE" --cpus-per-task="$CPUS_PER_TASK" \
    "${PYTHON:-python}" -u pretrain_gpt.py "${PRETRAIN_ARGS[@]}" &
srun_pid=$!
while true; do
    wait "$srun_pid" && status=0 || status=$?
    # above 128 with srun still running: a trapped signal interrupted `wait`
    (( status > 128 )) && kill -0 "$srun_pid" 2>/dev/null || break
done
echo "ranks exited with status $status; latest complete iteration: $(latest_iteration);" \
     "$(date -u +%FT%TZ)"

# The ranks stopped early on their own (time-limit warning or --exit-duration-in-mins) after
# saving: requeue this job so that it resumes in a new allocation. Not after a failure (a
# resubmission resumes), when Slurm ended the job (it requeues preempted jobs itself), or when
# this run saved no progress (a time limit shorter than the --signal time would loop).
if [[ $status == 0 && -z "$ended_by_slurm" && -n "$train_iters" && "${AUTO_REQUEUE:-1}" == 1 ]] \
        && (( started_at < $(latest_iteration) && $(latest_iteration) < train_iters )); then
    echo "stopped at iteration $(latest_iteration) of $train_iters: requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID" || echo "requeue refused: sbatch the script again to resume"
fi
exit "$status"
