"""`determined.launch`: dtrain takes `python3 -m determined.launch.torch_distributed` off a command entrypoint
and starts one process per slot itself; run directly, `torch_distributed` runs its command in this process."""
