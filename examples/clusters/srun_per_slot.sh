#!/bin/bash
# A Slurm batch job with one process per slot and no torchrun (as Lightning's users start jobs): srun starts
# `python -m dtrain.worker` 2 x 2 times, and each worker reads its rank from SLURM_PROCID, its local rank from
# SLURM_LOCALID and its node from SLURM_NODEID; the master is MASTER_ADDR if exported, else the first host of the
# node list (`scontrol show hostnames`), on MASTER_PORT if exported, else 20000 + the job id mod 20000.
# Restarts after a failure are Slurm's (--requeue), not torchrun's; the job resumes from the latest checkpoint.
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

set -euo pipefail
CONFIG=${1:-examples/fashion_mnist/distributed.yaml}
shift $(( $# > 0 ? 1 : 0 ))
srun --kill-on-bad-exit=1 python -m dtrain.worker "$CONFIG" --set resources.slots_per_trial=4 "$@"
