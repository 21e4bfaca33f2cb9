#!/bin/bash
# A Slurm batch job running a dtrain experiment on 2 nodes x 2 workers: one `dtrain run` per node (srun
# --ntasks-per-node=1), each starting its node's workers through torchrun's elastic agent, which restarts them
# after a failure (they resume from the latest checkpoint).
#
#   sbatch examples/clusters/sbatch.sh [CONFIG] [dtrain run options...]
#   sbatch examples/clusters/sbatch.sh examples/fashion_mnist/distributed.yaml --set searcher.max_length.batches=200
#
# Inside a job step `dtrain run` takes from Slurm what is not given on its command line: --nnodes (SLURM_NNODES),
# --node-rank (SLURM_NODEID), --master-addr (the first host of the node list, `scontrol show hostnames`),
# --master-port (MASTER_PORT if exported, else 20000 + the job id mod 20000), and the run dir:
# $DTRAIN_RUNS_ROOT (default ./runs, from the submit directory)/<name>/slurm-<job id> on the first node and
# .../slurm-<job id>-node<N> on node N (logs only; checkpoints are the first node's). Export DTRAIN_RUNS_ROOT to a
# shared file system before sbatch to keep the runs there. A requeued job keeps its id, so it resumes from the
# same run dir. Add --network-interface NAME when the nodes share a network other than the route to the master.
#SBATCH --job-name=dtrain
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --time=01:00:00
#SBATCH --requeue
#SBATCH --open-mode=append

set -euo pipefail
# Preemption (a partition with PreemptMode=REQUEUE and a GraceTime) sends SIGTERM to the job: the workers finish
# their batch and write a checkpoint, and `dtrain run` on the first node requeues the job (scontrol requeue), which
# starts again later with the same job id and so resumes from the same run dir. SIGUSR1 does the same at any time
# (`scancel --signal=USR1 JOB`, or `sbatch --signal=USR1@120` before the time limit). With `--signal=B:USR1@N`
# (only this shell gets it) the trap below passes it on to the step. The shell waits for the step meanwhile
# (without the TERM trap SIGTERM would end it at once and the step with it).
trap 'echo "sbatch.sh: SIGTERM (preemption or scancel): waiting for the workers to checkpoint" >&2' TERM
trap 'echo "sbatch.sh: SIGUSR1: the workers checkpoint and the job is requeued" >&2
      scancel --signal=USR1 "$SLURM_JOB_ID" || true' USR1
CONFIG=${1:-examples/fashion_mnist/distributed.yaml}
shift $(( $# > 0 ? 1 : 0 ))
# --kill-on-bad-exit: a node that fails (e.g. cannot reach the master) ends the step instead of leaving the
# other node waiting for it
srun --ntasks-per-node=1 --kill-on-bad-exit=1 dtrain run "$CONFIG" --set resources.slots_per_trial=4 "$@" &
step=$!
code=0
while true; do  # a trapped signal ends `wait` early: wait again until the step has ended
  code=0
  wait "$step" || code=$?
  kill -0 "$step" 2>/dev/null || break
done
exit "$code"
