"""Sharded and pipelined layouts in the config (one line per impossible layout), the precision a run trains in,
the bf16 warning, and activation checkpointing by block type (same gradients, fewer saved activations)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from dtrain.config import effective_precision, load_config
from dtrain.errors import ConfigError
from dtrain.train.memory import apply_activation_checkpointing
from dtrain.train.precision import cpu_has_native_bf16

BASE: dict[str, Any] = {
    "entrypoint": "model_def:T", "hyperparameters": {"global_batch_size": 32},
    "searcher": {"metric": "loss", "max_length": {"batches": 4}}, "resources": {"slots_per_trial": 4},
}


def raw_with(**sections: Any) -> dict[str, Any]:
    raw = copy.deepcopy(BASE)
    raw.update(sections)
    return raw


@pytest.mark.parametrize(("raw", "words"), [
    (raw_with(distributed={"strategy": "pipeline", "pipeline": {"stages": 3}}),
     "distributed.pipeline.stages (3) must divide resources.slots_per_trial (4)"),
    (raw_with(distributed={"strategy": "pipeline", "pipeline": {"stages": 2, "microbatches": 5}}),
     "global_batch_size (32) must split into 2 pipeline replica(s) x 5 microbatches"),
    (raw_with(distributed={"strategy": "pipeline", "pipeline": {"split_points": ["a", "b"]}}),
     "names 2 cut(s) (a, b) for 2 stages"),
    (raw_with(distributed={"strategy": "pipeline"}, optimizations={"aggregation_frequency": 2}),
     "raise distributed.pipeline.microbatches instead"),
    (raw_with(distributed={"strategy": "fsdp", "op": "sum"}), "distributed.op `sum` applies to strategy allreduce"),
    (raw_with(distributed={"strategy": "zero1", "compression": {"name": "fp16"}}),
     "gradient compression `fp16` applies to strategy allreduce or local_sgd, not to zero1"),
    (raw_with(optimizations={"mixed_precision": "O1", "precision": "bf16"}), "name two precisions"),
    (raw_with(optimizations={"precision": "fp16"}, distributed={"strategy": "parameter_server"}),
     "cannot give; use bf16"),
    (raw_with(distributed={"strategy": "pipeline", "pipeline": {"schedule": "interleaved"}}),
     "distributed.pipeline.schedule"),
])
def test_impossible_layouts_are_one_line_each(raw: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, raw=raw)
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_possible_layouts_load() -> None:
    config = load_config(None, raw=raw_with(distributed={"strategy": "fsdp", "fsdp": {"reshard_after_forward": False}},
                                            optimizations={"precision": "bf16"})).config
    assert config.distributed.strategy == "fsdp" and effective_precision(config.optimizations) == "bf16"
    assert load_config(None, raw=raw_with(distributed={"strategy": "zero1"})).config.distributed.strategy == "zero1"


@pytest.mark.parametrize(("level", "precision"), [("O0", "fp32"), ("O1", "fp16"), ("O2", "fp16")])
def test_determined_mixed_precision_levels_map_to_a_precision(level: str, precision: str) -> None:
    config = load_config(None, raw=raw_with(optimizations={"mixed_precision": level})).config
    assert effective_precision(config.optimizations) == precision


def test_o3_is_refused_by_name_before_a_run_starts() -> None:
    from dtrain.config import check_buildable

    with pytest.raises(ConfigError, match="O3"):
        check_buildable(load_config(None, raw=raw_with(optimizations={"mixed_precision": "O3"})).config)


def test_native_bf16_is_read_from_the_cpu_flags() -> None:
    assert cpu_has_native_bf16("flags : fpu sse avx512f avx512_bf16 amx_tile")
    assert cpu_has_native_bf16("flags : fpu amx_bf16")
    assert not cpu_has_native_bf16("flags : fpu sse avx2 avx512f")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) * 2


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(Block(), Block(), nn.Linear(8, 1)).double()


def _saved_tensors(model: nn.Module, x: torch.Tensor) -> int:
    count = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).sum()
    loss.backward()
    return count


def test_activation_checkpointing_keeps_gradients_and_saves_fewer_activations() -> None:
    x = torch.randn(4, 8, dtype=torch.float64)
    plain, checkpointed = _model(), _model()
    assert apply_activation_checkpointing(checkpointed, ["Block"]) == ["0", "1"]
    plain_saved, checkpointed_saved = _saved_tensors(plain, x), _saved_tensors(checkpointed, x)
    assert checkpointed_saved < plain_saved
    for a, b in zip(plain.parameters(), checkpointed.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        assert torch.equal(a.grad, b.grad)


def test_a_block_type_the_model_lacks_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="names Blok, which the model does not contain; its block types are"):
        apply_activation_checkpointing(_model(), ["Blok"])
