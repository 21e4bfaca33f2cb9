"""Per-stage construction of a pipeline (no processes): a rank that built the model on the meta device gets its own
stage's tensors allocated with rank 0's strides, the other stages' with their shapes and no storage, and tied
tensors stay tied. And the buckets the replicas average a stage's gradients in."""

from __future__ import annotations

import torch
from torch import nn

from dtrain.sync.pipeline import cut_model, gradient_buckets
from dtrain.sync.pipeline_state import materialize_stage, tensors_and_stages


class TiedConvNet(nn.Sequential):
    """Stage 0: a convolution and a batch norm (a buffer); stage 1: a linear layer whose weight is also a parameter
    of stage 0 (tied), and a head."""

    def __init__(self) -> None:
        shared = nn.Linear(4, 4, bias=False)
        super().__init__(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.AdaptiveAvgPool1d(4), shared,
                         nn.Linear(4, 2))
        self.mirror = nn.Linear(4, 4, bias=False)
        self.mirror.weight = shared.weight  # tied across the cut


def test_a_meta_rank_allocates_its_own_stage_only_with_rank_0s_strides() -> None:
    with torch.device("meta"):
        model = TiedConvNet()
    parts = cut_model(model, 2, ["4"])
    parts[0].add_module("mirror", model.mirror)  # the tied layer belongs to stage 0 as well
    tensors = tensors_and_stages(model, parts)
    channels_last = [torch.empty(t.shape).contiguous(memory_format=torch.channels_last).stride() if t.dim() == 4
                     else t.stride() for t, _ in tensors]
    received, released_bytes = materialize_stage(model, tensors, channels_last, 1, torch.device("cpu"))
    conv, shared, head = model[0], model[4], model[5]
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert conv.weight.untyped_storage().nbytes() == 0 and model[1].running_mean.untyped_storage().nbytes() == 0
    assert conv.weight.stride() == torch.empty(4, 3, 3, 3).contiguous(memory_format=torch.channels_last).stride()
    assert head.weight.untyped_storage().nbytes() == 2 * 4 * 4 and head.bias.untyped_storage().nbytes() == 2 * 4
    assert model.mirror.weight is shared.weight and shared.weight.untyped_storage().nbytes() == 4 * 4 * 4
    assert isinstance(shared.weight, nn.Parameter) and shared.weight.requires_grad
    assert {id(t) for t in received.values()} == {id(shared.weight), id(head.weight), id(head.bias)}
    released = {id(t) for t in [conv.weight, conv.bias, *model[1].parameters(), *model[1].buffers()]}
    assert set(released_bytes) == released
    conv.weight.untyped_storage().resize_(released_bytes[id(conv.weight)])  # what unwrap_model gives back
    assert conv.weight.untyped_storage().nbytes() == 4 * 3 * 3 * 3 * 4


def test_gradients_are_averaged_in_buckets_of_one_dtype_within_the_limit() -> None:
    """The replicas' all-reduce copies one bucket at a time (not the whole stage's gradients)."""
    grads = [torch.zeros(10), torch.zeros(10), torch.zeros(30), torch.zeros(5, dtype=torch.float64),
             torch.zeros(5, dtype=torch.float64), torch.zeros(2)]
    sizes = [[g.numel() for g in bucket] for bucket in gradient_buckets(grads, 80)]
    assert sizes == [[10, 10], [30], [5, 5], [2]]  # 40 + 40 bytes fit; 120 bytes alone; a dtype change cuts
    assert [len(b) for b in gradient_buckets(grads, 10**9)] == [3, 2, 1]
    assert list(gradient_buckets([], 80)) == []
