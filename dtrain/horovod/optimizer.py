"""`hvd.DistributedOptimizer`: wraps a torch optimizer so that `step()` first averages the gradients over the
ranks, with Horovod's semantics (backward_passes_per_step, gradient_predivide_factor, synchronize /
skip_synchronize, zero gradients for parameters a rank did not use).

How it differs inside: Horovod launches one allreduce per parameter from a gradient hook, matched by name in a
background cycle. Here gradients are fused into buckets (per dtype, in the order backward produces them, up to
HOROVOD_FUSION_THRESHOLD bytes, 4 MiB by default, 0 = one per tensor); a gradient hook counts backward passes,
and a bucket's allreduce is posted to the negotiation by name (`negotiation.py`) as soon as all its gradients
are ready, so it travels while backward goes on, as DDP's buckets do. `synchronize()` starts what is left and
waits. Every rank submits every bucket (with zero gradients where its graph did not use a parameter), so
data-dependent graphs cannot hang. With `op=hvd.Adasum` the gradients (not Horovod's
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
from dtrain.horovod.basics import Adasum, Average, ProcessSet, Sum, global_process_set
from dtrain.horovod.compression import Compression, DtrainCompressor

STEP_WARNING = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
                "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.")
TOO_MANY_PASSES = ("Gradients were computed more than backward_passes_per_step times before call to step(). "
                   "Increase backward_passes_per_step to accumulate gradients locally.")
ZERO_GRAD_RACE = ("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                  "optimizer.synchronize(). This is prohibited as it can cause a race condition.")


DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024


def fusion_threshold_bytes() -> int:
    """HOROVOD_FUSION_THRESHOLD if set (0 = a bucket per tensor), else 4 MiB. Horovod's default is 128 MiB, but
    its fusion only joins tensors ready within one 1-ms cycle, so its buffers are small in practice; here a
    bucket waits for all its gradients, and 4 MiB buckets let the first ones travel while backward goes on."""
    return int(os.environ.get("HOROVOD_FUSION_THRESHOLD", str(DEFAULT_BUCKET_BYTES)))


class _DistributedOptimizer:
    """Mixed into a subclass of the wrapped optimizer's class, so `isinstance(opt, torch.optim.SGD)` holds."""

    _parameter_names: dict[torch.Tensor, str]

    def _setup(self, named_parameters: Any, compression: Any, backward_passes_per_step: int, op: int,
               gradient_predivide_factor: float, groups: Any, process_set: ProcessSet,
               sparse_as_dense: bool = False) -> None:
        if backward_passes_per_step <= 0:
            raise ValueError(f"backward_passes_per_step must be > 0, got {backward_passes_per_step}")
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        # mixed into the user's optimizer class, which has param_groups
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
                                     enumerate(self.param_groups)  # type: ignore[attr-defined]  # as above
                                     for i, p in enumerate(group["params"])}
        self._compression = compression if compression is not None else Compression.none
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.process_set = process_set
        self._groups = groups
        self._sparse_as_dense = sparse_as_dense
        self._sparse: set[torch.Tensor] = set()  # parameters that have had a sparse gradient
        self._params = [p for p in params if p.requires_grad]
        self._passes = {p: backward_passes_per_step for p in self._params}
        self._synchronized = False
        self._should_synchronize = True
        self._warned = False
        self._compressor_state: Any = None
        self._communicates = process_set.included() and (
            basics.size() > 1 or os.environ.get("HOROVOD_ELASTIC") == "1")
        self._plan_buckets()
        if self._communicates:
            for p in self._params:
                p.register_post_accumulate_grad_hook(self._counted)

    def _counted(self, p: torch.Tensor) -> None:
        if self._passes[p] <= 0:
            raise AssertionError(TOO_MANY_PASSES)
        self._passes[p] -= 1
        if self._passes[p] == 0:
            self._ready.add(p)
            self._launch_ready()

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        self._passes = {p: passes for p in self._params}

    def _plan_buckets(self) -> None:
        """Fuse the gradients, in the order backward produces them (the reverse of the parameters'), into buckets
        of one dtype up to the fusion threshold; a bucket is reduced as soon as all its gradients are ready."""
        limit = fusion_threshold_bytes()
        buckets: list[list[torch.Tensor]] = []
        current: dict[torch.dtype, list[torch.Tensor]] = {}
        sizes: dict[torch.dtype, int] = {}
        for p in reversed(self._params):
            nbytes = p.numel() * p.element_size()
            if current.get(p.dtype) and (limit == 0 or sizes[p.dtype] + nbytes > limit):
                buckets.append(current.pop(p.dtype))
                sizes[p.dtype] = 0
            current.setdefault(p.dtype, []).append(p)
            sizes[p.dtype] = sizes.get(p.dtype, 0) + nbytes
        buckets.extend(current.values())
        self._bucket_list = buckets
        self._ready: set[torch.Tensor] = set()
        self._next_bucket = 0
        self._inflight: list[tuple[list[torch.Tensor], Any]] = []

    def _launch_ready(self) -> None:
        """Start, in bucket order (the same on every rank), each bucket whose gradients are all ready."""
        while self._next_bucket < len(self._bucket_list) and all(
                p in self._ready for p in self._bucket_list[self._next_bucket]):
            self._launch(self._next_bucket)
            self._next_bucket += 1

    def _launch(self, index: int) -> None:
        bucket = self._bucket_list[index]
        keep_sparse = not self._sparse_as_dense and self.op in (Average, Sum)
        for p in bucket:
            assert p.grad is not None  # a hook fired, or synchronize() gave it zeros
            if p.grad.is_sparse:
                self._sparse.add(p)
                if keep_sparse:  # as Horovod: indices and values all-gathered, the gradient stays sparse
                    handle = ops.sparse_allreduce_async(p.grad, self._parameter_names[p], self.op,
                                                        self.process_set)
                    self._inflight.append(([p], handle))
        bucket = [p for p in bucket if not (keep_sparse and p.grad is not None and p.grad.is_sparse)]
        if not bucket:
            return
        grads = [g.to_dense() if g.is_sparse else g for g in (p.grad for p in bucket) if g is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        name = f"{self._parameter_names[bucket[0]]}" + (f"+{len(bucket) - 1}" if len(bucket) > 1 else "")
        if self.op == Adasum or isinstance(self._compression, DtrainCompressor):
            reduced = self._reduce(flat, index, [g.numel() for g in grads], name)
            self._inflight.append((bucket, lambda: reduced))
            return
        factor = self.gradient_predivide_factor
        compressed, context = self._compression.compress(flat)
        buffer, work, post = ops._start_allreduce(compressed, self.op, 1.0 / factor, factor, self.process_set, name)

        def finish() -> torch.Tensor:
            if work is not None:
                work.wait()
            out = ops._finish_allreduce(compressed, buffer, post, None)
            return self._compression.decompress(out, context)

        self._inflight.append((bucket, finish))

    def synchronize(self) -> None:
        """Finish reducing (average, or `op`) every gradient over the process set; `step()` then needs
        `skip_synchronize()` to not do it again. A parameter this rank did not use gets a zero gradient, so
        every rank submits the same buckets."""
        if not self._communicates:
            self._synchronized = True
            return
        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
                if p in self._sparse and not self._sparse_as_dense:
                    p.grad = p.grad.to_sparse()
        self._ready.update(self._params)
        self._launch_ready()
        for bucket, finish in self._inflight:
            reduced = finish()
            if reduced.is_sparse:
                bucket[0].grad = reduced.coalesce()
                continue
            offset = 0
            with torch.no_grad():
                for p in bucket:
                    grad = p.grad
                    assert grad is not None
                    n = grad.numel()
                    if grad.is_sparse:  # sparse_as_dense: reduced dense, handed back sparse, as Horovod does, so
                        # that an optimizer that takes only sparse gradients (SparseAdam) still steps
                        p.grad = reduced[offset:offset + n].view(grad.shape).clone().to_sparse(grad.sparse_dim())
                    else:
                        grad.copy_(reduced[offset:offset + n].view_as(grad))
                    offset += n
        self._ready, self._next_bucket, self._inflight = set(), 0, []
        self._passes = {p: self.backward_passes_per_step for p in self._params}
        self._synchronized = True

    def _reduce(self, flat: torch.Tensor, index: int, lengths: list[int], name: str) -> torch.Tensor:
        if self.op == Adasum:
            buffer, work, _ = ops._start_allreduce(flat, Adasum, 1.0, 1.0, self.process_set, name, lengths)
            work.wait()
            return buffer
        if isinstance(self._compression, DtrainCompressor):
            return self._reduce_with_dtrain(flat, index, lengths, name)
        factor = self.gradient_predivide_factor
        compressed, context = self._compression.compress(flat)
        reduced = ops._allreduce_now(compressed, self.op, 1.0 / factor, factor, self.process_set, name)
        return self._compression.decompress(reduced, context)

    def _reduce_with_dtrain(self, flat: torch.Tensor, index: int, lengths: list[int], name: str) -> torch.Tensor:
        from dtrain.compress import BucketInfo, WireStats
        from dtrain.sync.hooks import run_round

        # only called with a DtrainCompressor (the caller checks)
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
        # super() is the user's optimizer class, which this class is mixed into
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
        super().zero_grad(set_to_none)  # type: ignore[misc]  # as in _base_step

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # type: ignore[misc]  # as in _base_step
        self._passes = {p: self.backward_passes_per_step for p in self._params}
        self._ready, self._next_bucket, self._inflight = set(), 0, []
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
                    groups, process_set, sparse_as_dense)
    return instance
