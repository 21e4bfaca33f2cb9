#!/bin/bash
# A Slurm batch job running a dtrain experiment on 2 nodes x 2 workers: one `dtrain run` per node (srun
# --ntasks-per-node=1), each starting its node's workers through torchrun's elastic agent, which restarts them
# after a failure (they resume from the latest checkpoint). Submit with: sbatch examples/clusters/sbatch.sh
#SBATCH --job-name=dtrain-fashion-mnist
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --time=01:00:00

set -euo pipefail
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
MASTER_PORT=29500
RUN_DIR="$HOME/runs/fashion-mnist-$SLURM_JOB_ID"   # on a shared file system: the chief's checkpoints

# --node-rank comes from each task's SLURM_NODEID; the interface is picked from the route to MASTER_ADDR
# (add --network-interface NAME when the machines share a different network).
srun bash -c "dtrain run examples/fashion_mnist/distributed.yaml --set resources.slots_per_trial=4 \
  --nnodes $SLURM_NNODES --node-rank \$SLURM_NODEID --master-addr $MASTER_ADDR --master-port $MASTER_PORT \
  --run-dir $RUN_DIR/node-\$SLURM_NODEID"
