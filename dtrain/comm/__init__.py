"""A thin layer over torch.distributed: initialisation from the launcher's environment, Topology, helpers."""

from dtrain.comm.collectives import all_gather_object, all_reduce_sums, any_rank, barrier, broadcast_object, rank_flags
from dtrain.comm.topology import (
    LaunchEnv,
    Topology,
    check_devices,
    device_mesh,
    init_distributed,
    read_launch_env,
    shutdown_distributed,
)

__all__ = ["LaunchEnv", "Topology", "all_gather_object", "all_reduce_sums", "any_rank", "barrier",
           "broadcast_object", "check_devices", "device_mesh", "init_distributed", "rank_flags", "read_launch_env",
           "shutdown_distributed"]
