"""Keys of Determined's experiment file that configure its cluster rather than training: a classic file with
them still runs, and each one found is dropped with a warning that says why it has no effect."""

from __future__ import annotations

from typing import Any

IGNORED_KEYS: dict[str, str] = {
    "environment": "dtrain runs in the current Python environment, not in containers",
    "bind_mounts": "dtrain runs on the host filesystem, not in containers",
    "workspace": "dtrain has no workspaces; runs are grouped by name under runs/",
    "project": "dtrain has no projects; runs are grouped by name under runs/",
    "log_policies": "dtrain does not match log lines",
    "retention_policy": "dtrain keeps logs in the run dir",
    "preemption_timeout": "dtrain has no scheduler that preempts",
    "tensorboard_storage": "dtrain writes TensorBoard events into the run dir",
    "slurm": "start dtrain under Slurm with srun instead (docs/guide.md, 'Under plain torchrun or Slurm')",
    "pbs": "dtrain does not submit PBS jobs",
    "resources.resource_pool": "dtrain has no resource pools",
    "resources.priority": "dtrain has no scheduler",
    "resources.weight": "dtrain has no scheduler",
    "resources.shm_size": "dtrain runs on the host, not in containers",
    "resources.max_slots": "one experiment runs one trial",
    "resources.is_single_node": "nodes are given on the command line (--nnodes)",
    "resources.devices": "dtrain runs on the host, not in containers",
    "resources.native_parallel": "a legacy Determined flag",
    "optimizations.tensor_fusion_cycle_time": "fusion follows DDP's buckets, not Horovod's cycle",
    "optimizations.grad_updates_size_file": "it had no effect in Determined either",
}


def drop_ignored_keys(data: dict[str, Any]) -> list[str]:
    """Remove the ignored keys from a raw config dict in place; return one warning per key removed."""
    warnings = []
    for dotted, reason in IGNORED_KEYS.items():
        section, _, key = dotted.rpartition(".")
        node = data.get(section) if section else data
        if isinstance(node, dict) and key in node:
            node.pop(key)
            warnings.append(f"config key `{dotted}` has no effect in dtrain ({reason}); ignored")
    return warnings
