"""Horovod's PyTorch API (`import horovod.torch as hvd`) on torch.distributed, and what `dtrain horovodrun`
needs to run Horovod scripts unchanged. The public names are in `dtrain.horovod.torch`; docs/horovod.md maps
each one and says what differs."""
