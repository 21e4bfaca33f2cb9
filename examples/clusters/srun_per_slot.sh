#!/bin/bash
# A Slurm batch job with one process per slot and no torchrun (as Lightning's users start jobs): srun starts
# `python -m dtrain.worker` 2 x 2 times, and each worker reads its rank from SLURM_PROCID, its local rank from
# SLURM_LOCALID and its node from SLURM_NODEID; the master is MASTER_ADDR if exported, else the first host of the
# node list (`scontrol show hostnames`), on MASTER_PORT if exported, else 20000 + the job id mod 20000.
# Restarts after a failure are Slurm's (--requeue), not torchrun's; the job resumes from the latest checkpoint.
# Preemption (SIGTERM with a PreemptTime) or SIGUSR1 (`scancel --signal=USR1 JOB`, `--signal=[B:]USR1@N`): every
# worker finishes its batch, rank 0 writes the checkpoint and requeues the job (scontrol requeue).
#
#   sbatch examples/clusters/srun_per_slot.sh [CONFIG] [--set KEY=VALUE ...]
#
# The run dir is $DTRAIN_RUNS_ROOT (default ./runs)/<name>/slurm-<job id>, shared by the nodes when it is on a
# shared file system (the first node prepares it; without one each node prepares its own and the first node's
# holds the checkpoints). A requeued job keeps its id and resumes there.
#SBATCH --job-name=dtrain-per-slot
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=1
#SBATCH --time=01:00:00
#SBATCH --requeue
#SBATCH --open-mode=append

set -euo pipefail
trap 'echo "srun_per_slot.sh: SIGTERM (preemption or scancel): waiting for the workers to checkpoint" >&2' TERM
trap 'echo "srun_per_slot.sh: SIGUSR1: the workers checkpoint and the job is requeued" >&2
      scancel --signal=USR1 "$SLURM_JOB_ID" || true' USR1
CONFIG=${1:-examples/fashion_mnist/distributed.yaml}
shift $(( $# > 0 ? 1 : 0 ))
srun --kill-on-bad-exit=1 python -m dtrain.worker "$CONFIG" --set resources.slots_per_trial=4 "$@" &
step=$!
code=0
while true; do  # a trapped signal ends `wait` early: wait again until the step has ended
  code=0
  wait "$step" || code=$?
  kill -0 "$step" 2>/dev/null || break
done
exit "$code"
