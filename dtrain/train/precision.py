"""Mixed precision around the forward/backward stage: `torch.autocast` in the forward pass (bf16 or fp16), and
for fp16 torch's GradScaler, whose verdict on overflow every rank shares.

The weights, their gradients and the gradients' reduction stay fp32 (autocast casts inside the ops), so every
strategy and compressor sees the gradients it sees in fp32 training.

fp16 loss scaling: the loss is multiplied by the scaler's scale (folded into the stage's `loss_scale`), and when
the batch ends an update the gradients are unscaled. Each rank checks only the gradients it holds (with FSDP a
shard), so a rank may find an infinity that another does not; a scale that then differs between ranks makes the
replicas drift apart (pytorch/pytorch#136009). Here the found-inf flags are all-reduced (max) before the scaler
updates its scale, so every rank skips the same updates and keeps the same scale. A skipped update drops the
gradients (`grad = None`), so every optimizer leaves its parameters and state untouched on every rank.

Nothing here reads a tensor on the host: the scale multiplies the loss as a tensor, the scaler updates its scale
on the device, and the shared verdict waits for the update guard, whose one read per update carries it beside the
finite flag (`take_overflow`, `skip_update`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtrain.sync import ComputePhases, RunsForwardBackward, TrainBatch

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_warned: list[bool] = []


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """True when the CPU flags list avx512_bf16 or amx_bf16 (without them CPU autocast to bf16 is emulated and
    slower than fp32, pytorch/pytorch#118499)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return True  # not Linux: nothing to tell
    flags = set(cpuinfo.split())
    return "avx512_bf16" in flags or "amx_bf16" in flags


def warn_without_native_bf16(device: torch.device) -> bool:
    """Log once per process when bf16 autocast runs on a CPU without native bf16; True when it warned."""
    if device.type != "cpu" or _warned or cpu_has_native_bf16():
        return False
    _warned.append(True)
    log.warning("precision bf16: this CPU has no avx512_bf16 or amx_bf16 instructions, so autocast to bf16 is "
                "emulated and usually slower than fp32 (pytorch/pytorch#118499); use fp32 here")
    return True


class _AutocastPhases:
    """The Trainer's compute phases with the forward phase under autocast."""

    def __init__(self, phases: ComputePhases, device_type: str, dtype: torch.dtype) -> None:
        self.phases = phases
        self.device_type = device_type
        self.dtype = dtype

    @contextmanager
    def _forward(self) -> Iterator[None]:
        with self.phases.forward(), torch.autocast(self.device_type, dtype=self.dtype):
            yield

    def forward(self) -> AbstractContextManager[Any]:
        return self._forward()

    def backward(self) -> AbstractContextManager[Any]:
        return self.phases.backward()


class MixedPrecision:
    """Wraps a forward/backward stage (RunsForwardBackward): autocast in forward; with a scaler (fp16) the loss
    scale and, on the batch that ends an update, unscaling with a found-inf verdict all ranks share."""

    def __init__(self, inner: RunsForwardBackward, precision: str, device: torch.device,
                 scaler: torch.amp.GradScaler | None, optimizer: torch.optim.Optimizer, distributed: bool) -> None:
        self.inner = inner
        self.precision = precision
        self.dtype = DTYPES[precision]
        self.device = device
        self.scaler = scaler
        self.optimizer = optimizer
        self.distributed = distributed
        self.skipped = 0  # updates skipped for an fp16 overflow
        self._overflow: torch.Tensor | None = None  # this update's shared verdict (0 or 1), not read yet
        self.modules_in_fp32: list[str] | None = None  # found on the first forward pass
        if precision == "bf16":
            warn_without_native_bf16(device)

    def describe(self) -> dict[str, Any]:
        """What ran (summary.json's `precision`): the setting, autocast's dtype, and the modules with weights whose
        output autocast left in fp32 on the first forward pass (e.g. a GRU or LSTM under CPU autocast, whose op list
        has no recurrent ops)."""
        return {"name": self.precision, "autocast_dtype": str(self.dtype).removeprefix("torch."),
                "loss_scaling": self.scaler is not None, "modules_in_fp32": self.modules_in_fp32}

    @contextmanager
    def _watching_output_dtypes(self, model: nn.Module) -> Iterator[None]:
        """On the first forward pass: note every module holding floating weights of its own whose first floating
        output is fp32 under autocast."""
        if self.modules_in_fp32 is not None:
            yield
            return
        found: list[str] = []

        def watch(name: str, module: nn.Module) -> Any:
            def hook(_: nn.Module, __: Any, output: Any) -> None:
                first = output[0] if isinstance(output, (tuple, list)) and output else output
                if isinstance(first, torch.Tensor) and first.dtype == torch.float32:
                    label = f"{name} ({type(module).__name__})"
                    if label not in found:
                        found.append(label)
            return module.register_forward_hook(hook)

        handles = [watch(name, module) for name, module in model.named_modules()
                   if any(p.is_floating_point() for p in module.parameters(recurse=False))]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self.modules_in_fp32 = found

    def forward_backward(self, model: nn.Module, batch: Any, train_batch: TrainBatch, *,
                         loss_scale: float | torch.Tensor, communicate: bool,
                         phases: ComputePhases) -> Mapping[str, Any]:
        autocast_phases = _AutocastPhases(phases, self.device.type, self.dtype)
        if self.scaler is None:
            with self._watching_output_dtypes(model):
                return self.inner.forward_backward(model, batch, train_batch, loss_scale=loss_scale,
                                                   communicate=communicate, phases=autocast_phases)
        scale = self._scale()
        with self._watching_output_dtypes(model):
            outputs = self.inner.forward_backward(model, batch, train_batch, loss_scale=loss_scale * scale,
                                                  communicate=communicate, phases=autocast_phases)
        if communicate:
            self._unscale_and_agree()
        return {**outputs, "loss_scale": scale}

    def _scale(self) -> torch.Tensor:
        """The scale this batch's loss is multiplied by: a copy of the scaler's scale as a 0-d tensor on the device
        (its tensor is made on first use and updated in place after the update, so a copy keeps this batch's)."""
        assert self.scaler is not None
        if self.scaler._scale is None:  # noqa: SLF001 - created by scale(); one zero-cost call makes it
            self.scaler.scale(torch.zeros((), device=self.device))
        scale = self.scaler._scale  # noqa: SLF001 - get_scale() would read it on the host
        assert scale is not None
        return scale.detach().reshape(()).clone()

    def take_overflow(self) -> torch.Tensor | None:
        """This update's verdict, shared by every rank: a 0-d tensor, 1 when some rank's gradients overflowed (the
        update must be skipped), else 0; None without a scaler or once taken. The update guard reads it."""
        overflow, self._overflow = self._overflow, None
        return overflow

    def skip_update(self) -> None:
        """Drop the gradients of an update that overflowed, so every optimizer leaves its parameters and state
        untouched on every rank."""
        self.skipped += 1
        for group in self.optimizer.param_groups:
            for parameter in group["params"]:
                parameter.grad = None

    def _unscale_and_agree(self) -> None:
        """Unscale the gradients, make every rank's found-inf the maximum over the ranks and update the scale, all
        on the device; the verdict waits in `take_overflow` for the update guard."""
        assert self.scaler is not None
        self.scaler.unscale_(self.optimizer)
        found = self.scaler._per_optimizer_states[id(self.optimizer)]["found_inf_per_device"]  # noqa: SLF001
        flags = list(found.values())
        verdict = torch.stack(flags).sum().clamp(max=1.0) if flags else torch.zeros((), device=self.device)
        if self.distributed:
            dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
        for flag in flags:  # the scaler's update() reads these: the shared verdict on every rank
            flag.copy_(verdict)
        if not flags:  # no gradient on this rank: give update() the shared verdict to read
            found[self.device] = verdict
        self._overflow = verdict.reshape(())
        self.scaler.update()
