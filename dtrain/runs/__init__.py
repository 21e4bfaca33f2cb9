"""Run dirs and the run store: where a run's files live, who may write them, and what they say.

`rundir` (config.yaml, run.json, summary.json; registering and resuming), `store` (runs/metrics.db) and
`fatal` (fatal-error.json, the user error a worker hands to the launcher); `processes` (whether a process on
this host still runs).
"""
