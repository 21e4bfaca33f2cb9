"""`hvd.DistributedOptimizer`: wraps a torch optimizer so that `step()` first averages the gradients over the
ranks, with Horovod's semantics (backward_passes_per_step, gradient_predivide_factor, synchronize /
skip_synchronize, zero gradients for parameters a rank did not use).

How it differs inside: Horovod launches one allreduce per parameter from a gradient hook, matched by name in a
background cycle. Here hooks only count backward passes; `synchronize()` packs the gradients into fused
buffers (per dtype, up to HOROVOD_FUSION_THRESHOLD bytes, 128 MiB by default, 0 = one per tensor) and reduces
each with one negotiated allreduce. Every rank submits every gradient (a zero one where its graph did not use
the parameter), so data-dependent graphs cannot hang. With `op=hvd.Adasum` the gradients (not Horovod's
optimizer deltas) are combined by dtrain's Adasum, tensor by tensor.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from dtrain.horovod import basics, ops
from dtrain.horovod.basics import Adasum, Average, ProcessSet, global_process_set
from dtrain.horovod.compression import Compression, DtrainCompressor

STEP_WARNING = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
                "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.")
TOO_MANY_PASSES = ("Gradients were computed more than backward_passes_per_step times before call to step(). "
                   "Increase backward_passes_per_step to accumulate gradients locally.")
ZERO_GRAD_RACE = ("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                  "optimizer.synchronize(). This is prohibited as it can cause a race condition.")


def fusion_threshold_bytes() -> int:
    return int(os.environ.get("HOROVOD_FUSION_THRESHOLD", str(128 * 1024 * 1024)))


class _DistributedOptimizer:
    """Mixed into a subclass of the wrapped optimizer's class, so `isinstance(opt, torch.optim.SGD)` holds."""

    _parameter_names: dict[torch.Tensor, str]

    def _setup(self, named_parameters: Any, compression: Any, backward_passes_per_step: int, op: int,
               gradient_predivide_factor: float, groups: Any, process_set: ProcessSet) -> None:
        if backward_passes_per_step <= 0:
            raise ValueError(f"backward_passes_per_step must be > 0, got {backward_passes_per_step}")
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        params = [p for group in self.param_groups for p in group["params"]]  # type: ignore[attr-defined]
        if named_parameters is not None:
            named = list(named_parameters)
            if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
                raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually "
                                 "produced by model.named_parameters()")
            names = [name for name, _ in named]
            duplicates = sorted({n for n in names if names.count(n) > 1})
            if duplicates:
                raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: "
                                 f"{', '.join(duplicates)}")
            by_param = {id(p): name for name, p in named}
            missing = [p for p in params if id(p) not in by_param]
            if missing:
                raise ValueError(f"named_parameters was specified, but one or more model parameters were not named "
                                 f"({len(missing)} of them). Python object ids: "
                                 f"{', '.join(str(id(p)) for p in missing)}")
            self._parameter_names = {p: by_param[id(p)] for p in params}
        else:
            self._parameter_names = {p: f"allreduce.noname.{g}.{i}" for g, group in
                                     enumerate(self.param_groups)  # type: ignore[attr-defined]
                                     for i, p in enumerate(group["params"])}
        self._compression = compression if compression is not None else Compression.none
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.process_set = process_set
        self._groups = groups
        self._params = [p for p in params if p.requires_grad]
        self._passes = {p: backward_passes_per_step for p in self._params}
        self._synchronized = False
        self._should_synchronize = True
        self._warned = False
        self._compressor_state: Any = None
        self._communicates = process_set.included() and (
            basics.size() > 1 or os.environ.get("HOROVOD_ELASTIC") == "1")
        if self._communicates:
            for p in self._params:
                p.register_post_accumulate_grad_hook(self._counted)

    def _counted(self, p: torch.Tensor) -> None:
        if self._passes[p] <= 0:
            raise AssertionError(TOO_MANY_PASSES)
        self._passes[p] -= 1

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        self._passes = {p: passes for p in self._params}

    def _buckets(self) -> list[list[torch.Tensor]]:
        limit = fusion_threshold_bytes()
        buckets: list[list[torch.Tensor]] = []
        current: dict[torch.dtype, list[torch.Tensor]] = {}
        sizes: dict[torch.dtype, int] = {}
        for p in self._params:
            grad = p.grad
            assert grad is not None
            nbytes = grad.numel() * grad.element_size()
            if current.get(grad.dtype) and (limit == 0 or sizes[grad.dtype] + nbytes > limit):
                buckets.append(current.pop(grad.dtype))
                sizes[grad.dtype] = 0
            current.setdefault(grad.dtype, []).append(p)
            sizes[grad.dtype] = sizes.get(grad.dtype, 0) + nbytes
        buckets.extend(current.values())
        return buckets

    def synchronize(self) -> None:
        """Average (or reduce with `op`) every gradient over the process set now; `step()` then needs
        `skip_synchronize()` to not do it again."""
        if not self._communicates:
            self._synchronized = True
            return
        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:
                p.grad = p.grad.to_dense()  # sparse gradients travel dense (Horovod's sparse_as_dense)
        for index, bucket in enumerate(self._buckets()):
            grads = [p.grad for p in bucket if p.grad is not None]
            flat = torch.cat([g.reshape(-1) for g in grads])
            name = f"{self._parameter_names[bucket[0]]}" + (f"+{len(bucket) - 1}" if len(bucket) > 1 else "")
            reduced = self._reduce(flat, index, [g.numel() for g in grads], name)
            offset = 0
            with torch.no_grad():
                for grad in grads:
                    n = grad.numel()
                    grad.copy_(reduced[offset:offset + n].view_as(grad))
                    offset += n
        self._passes = {p: self.backward_passes_per_step for p in self._params}
        self._synchronized = True

    def _reduce(self, flat: torch.Tensor, index: int, lengths: list[int], name: str) -> torch.Tensor:
        if self.op == Adasum:
            from dtrain.comm.adasum import adasum_all_reduce_

            ops.negotiate("ALLREDUCE", name, flat, self.process_set.group, op=Adasum,
                          ranks=self.process_set.ranks)
            return adasum_all_reduce_(flat.clone(), lengths, self.process_set.group)
        if isinstance(self._compression, DtrainCompressor):
            return self._reduce_with_dtrain(flat, index, lengths, name)
        factor = self.gradient_predivide_factor
        compressed, context = self._compression.compress(flat)
        reduced = ops._allreduce_now(compressed, self.op, 1.0 / factor, factor, self.process_set, name)
        return self._compression.decompress(reduced, context)  # type: ignore[no-any-return]

    def _reduce_with_dtrain(self, flat: torch.Tensor, index: int, lengths: list[int], name: str) -> torch.Tensor:
        from dtrain.compress import BucketInfo, WireStats
        from dtrain.sync.hooks import run_round

        compressor = self._compression.compressor  # type: ignore[union-attr]
        world = self.process_set.size()
        ops.negotiate("ALLREDUCE", name, flat, self.process_set.group, op=self.op, ranks=self.process_set.ranks)
        info = BucketInfo.single(flat, key=index, world_size=world, rank=self.process_set.rank(),
                                 divisor=world if self.op == Average else 1,
                                 shapes=[torch.Size([n]) for n in lengths])
        wire = WireStats()
        round_ = compressor.compress(flat, info)
        decoded = compressor.decompress(run_round(round_, self.process_set.group, wire).wait(), round_.ctx)
        while (further := decoded.next_round) is not None:
            decoded = compressor.decompress(run_round(further, self.process_set.group, wire).wait(), further.ctx)
        compressor.state.end_bucket(info)
        assert decoded.gradient is not None
        return decoded.gradient

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside, `step()` does not synchronize (call `synchronize()` yourself first, e.g. to clip or unscale)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def _base_step(self, closure: Any = None) -> Any:
        return super().step(closure)  # type: ignore[misc]

    def step(self, closure: Any = None) -> Any:
        if self._should_synchronize:
            if self._synchronized and not self._warned:
                warnings.warn(STEP_WARNING, stacklevel=2)
                self._warned = True
            self.synchronize()
        self._synchronized = False
        return self._base_step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._communicates and any(count == 0 for count in self._passes.values()):
            raise AssertionError(ZERO_GRAD_RACE)
        super().zero_grad(set_to_none)  # type: ignore[misc]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # type: ignore[misc]
        self._passes = {p: self.backward_passes_per_step for p in self._params}
        self._synchronized = False


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Any = None,  # noqa: N802
                         compression: Any = Compression.none, backward_passes_per_step: int = 1,
                         op: int = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Any = None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set) -> Any:
    """An optimizer of the same class as `optimizer`, over its parameter groups (shared: learning-rate changes
    through either are seen by both) with fresh state, whose `step()` first reduces the gradients over
    `process_set`. `groups`/`num_groups` are accepted: every gradient is fused anyway."""
    if num_groups:
        warnings.warn("num_groups is deprecated; use groups", DeprecationWarning, stacklevel=2)
    base = optimizer.__class__
    cls: Any = type(base.__name__, (_DistributedOptimizer, base), {})
    instance = cls.__new__(cls)
    for key, value in optimizer.__dict__.items():
        if key not in ("state", "param_groups", "defaults"):
            instance.__dict__[key] = value
    torch.optim.Optimizer.__init__(instance, optimizer.param_groups, dict(optimizer.defaults))
    instance.param_groups = optimizer.param_groups  # the same dicts: lr schedules act on both
    instance._setup(named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor,
                    groups, process_set)
    return instance
