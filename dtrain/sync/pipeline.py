"""Pipeline x data parallelism on a 2-D DeviceMesh ("data", "pipeline"): the model is cut into p stages, rank
d*p + s runs stage s of pipeline replica d, and each replica's batch is split into m microbatches that a
schedule from torch.distributed.pipelining (GPipe or 1F1B) moves through the stages. After the backward pass
each stage's gradients are averaged over the replicas (the "data" dimension), so every replica applies the same
update. The interleaved schedules are not offered: on gloo they may hang (pytorch/PiPPy#944).

Where the model is cut: `distributed.pipeline.split_points` names the top-level children where stages 2..p
begin; else a model method `pipeline_stages(p)` returns the p stage modules; else the children are cut into p
runs of equal length. The top-level children must run in order (an nn.Sequential), each stage taking and returning
one tensor: the first training step runs every stage on an example microbatch and stops the run with a TrialError
naming the stage, its modules and what it returned or raised (`_run_stage`). The loss of the last stage
comes from the Trial's `pipeline_loss(outputs, targets)`, and batches are `(inputs, targets)`.

Each rank keeps only its own stage's parameters while it trains: the other stages' parameters and buffers keep
their shapes (and the optimizer its references to them) but their storage is freed (resized to 0 bytes); they get
no gradient, so the optimizer keeps no state for them. Validation runs through the stages when the Trial defines
`pipeline_metrics(outputs, targets)` (`forward_in_stages`: each stage its own part, the metrics on the last); else,
the other stages are allocated again and broadcast from their owners (`unwrap_model`), so that validation sees one
whole model; the next training step frees them again. Construction (ShardedConstruction): rank 0 builds the model
(the run's initial weights), the others build it on the meta device and receive only their own stage from rank 0.
Checkpoints (WritesShardedCheckpoint): each stage writes its own parameters, buffers and optimizer state through
torch.distributed.checkpoint, under the whole model's names; `dtrain export` joins them into a plain model.pt (both
in dtrain/sync/pipeline_state.py). The end-of-run replica check compares each stage with the same stage of the other
replicas (HoldsModelParts). The stage shapes the schedule needs are found by the stages in turn (each runs its own
part on a microbatch of the shape the previous stage announced), since no rank holds the other stages' weights.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from dtrain.comm import Topology, all_gather_object, device_mesh
from dtrain.config import ExperimentConfig
from dtrain.errors import ConfigError, TrialError
from dtrain.runs.storage import ShardFolder
from dtrain.sync.base import ComputePhases, StrategyBase, TrainBatch
from dtrain.sync.pipeline_state import distribute_stages, load_stage, save_stage
from dtrain.sync.spec import StrategySpec

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
REPLICA_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size


def gradient_buckets(grads: Sequence[torch.Tensor], limit_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of `grads` of one dtype, each as long as it stays within `limit_bytes` (a gradient larger
    than the limit is a bucket of its own)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for grad in grads:
        nbytes = grad.numel() * grad.element_size()
        if bucket and (size + nbytes > limit_bytes or grad.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(grad)
        size += nbytes
    if bucket:
        yield bucket


def cut_model(model: nn.Module, stages: int, split_points: Sequence[str]) -> list[nn.Module]:
    """The model's p stages (sharing its parameters): cut at `split_points`, by the model's own
    `pipeline_stages(p)`, or into equal runs of its top-level children."""
    own_cut = getattr(model, "pipeline_stages", None)
    if not split_points and callable(own_cut):
        parts = list(own_cut(stages))
        if len(parts) != stages:
            raise TrialError(f"the model's pipeline_stages({stages}) returned {len(parts)} modules; return {stages}")
        return parts
    children = list(model.named_children())
    names = [name for name, _ in children]
    if split_points:
        missing = [point for point in split_points if point not in names]
        if missing:
            raise ConfigError(f"distributed.pipeline.split_points {list(split_points)}: {', '.join(missing)} is not "
                              f"a top-level child of the model; its children are {', '.join(names)}")
        cuts = [names.index(point) for point in split_points]
        if cuts != sorted(cuts) or 0 in cuts or len(set(cuts)) != len(cuts):
            raise ConfigError(f"distributed.pipeline.split_points {list(split_points)} must name children in model "
                              f"order after the first ({', '.join(names)}), one per stage boundary")
    else:
        if len(children) < stages:
            raise ConfigError(f"the model has {len(children)} top-level children, fewer than the {stages} stages; "
                              "lower distributed.pipeline.stages or name split_points")
        cuts = [round(len(children) * s / stages) for s in range(1, stages)]
    bounds = [0, *cuts, len(children)]
    return [nn.Sequential(OrderedDict(children[bounds[s]:bounds[s + 1]])) for s in range(stages)]


class PipelineStrategy(StrategyBase):
    """Stages over the mesh's "pipeline" dimension, replicas over its "data" dimension. Core protocol plus
    ShardedConstruction (each rank receives only its stage), RunsForwardBackward (the schedule), Consolidating and
    OwnsCheckpointState (stages gathered from their owners), WritesShardedCheckpoint (each stage writes its own
    part), EvaluatesInStages (validation through the stages), HoldsModelParts (the replica check per stage) and
    `observe_waits` (the bubble)."""

    name = "pipeline"

    def __init__(self, topology: Topology, *, stages: int, microbatches: int, schedule: str,
                 split_points: Sequence[str] = (), receives: str = "on_demand") -> None:
        self.topology = topology
        self.stages = stages
        self.microbatches = microbatches
        self.schedule_name = schedule
        self.receives = receives
        self.split_points = list(split_points)
        self.replicas = topology.world_size // stages
        self.mesh = device_mesh(topology, (self.replicas, stages), ("data", "pipeline"))
        self.stage_index = self.mesh.get_local_rank("pipeline")
        self.evaluation_replica = self.mesh.get_local_rank("data")
        self.evaluation_replicas = self.replicas
        self.pipeline_group = self.mesh.get_group("pipeline")
        self.data_group = self.mesh.get_group("data")
        self._model: nn.Module | None = None
        self._parts: list[nn.Module] = []
        self._schedule: Any = None
        self._schedule_key: tuple[Any, ...] = ()
        self._loss_scale: float | torch.Tensor = 1.0
        self._losses: list[torch.Tensor] = []
        self._pipeline_loss: Any = None
        self._stale = False
        self._released: dict[int, int] = {}  # id(tensor) -> its storage's bytes, for the other stages' tensors
        self._record: Callable[[str, float], None] | None = None
        self._compute_seconds = 0.0  # this stage's own forward, loss and backward compute in the current schedule
        self.computing = False  # True while this stage runs its own forward, loss or backward (not a wait)

    # ------------------------------------------------------------------------------- core protocol

    def model_construction(self) -> AbstractContextManager[Any]:
        """ShardedConstruction: rank 0 builds the real model (its weights are the run's initial weights); the others
        build it on the meta device, which allocates nothing, and receive their own stage's tensors from rank 0 when
        it is wrapped."""
        return nullcontext() if self.topology.rank == 0 else torch.device("meta")

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Cut the model into stages; ranks that built it on the meta device allocate and receive their own stage
        from rank 0; every rank then frees the other stages' storage (it trains only its own)."""
        self._model = model
        self._parts = cut_model(model, self.stages, self.split_points)
        self._sizes = [sum(p.numel() for p in part.parameters()) for part in self._parts]
        self._released.update(distribute_stages(model, self._parts, self.stage_index, self.topology))
        self._release_other_stages()
        return model

    def unwrap_model(self) -> nn.Module:
        """The whole model: the other stages allocated again and broadcast from their owners when they were freed
        or changed (collective); the next training step frees them again."""
        assert self._model is not None, "wrap_model() first"
        if self._released:
            self._allocate_other_stages()
            self._stale = True
        if self._stale:
            self._gather_stages()
        return self._model

    def no_sync(self) -> AbstractContextManager[Any]:
        return nullcontext()  # gradients are averaged over the replicas only when forward_backward communicates

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()
        self._stale = True

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "stages": self.stages, "replicas": self.replicas,
                "microbatches": self.microbatches, "schedule": self.schedule_name, "receives": self.receives,
                "stage_parameters": self._sizes,
                "bubble_fraction": (self.stages - 1) / (self.microbatches + self.stages - 1)}

    def close(self) -> None:
        self._schedule = None

    # ---------------------------------------------------------------------------------- extensions

    def forward_backward(self, model: nn.Module, batch: Any, train_batch: TrainBatch, *,
                         loss_scale: float | torch.Tensor, communicate: bool,
                         phases: ComputePhases) -> Mapping[str, Any]:
        """Run the schedule over this replica's batch; the last stage's mean loss is broadcast to the pipeline."""
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise TrialError("strategy pipeline needs batches of (inputs, targets); the batch was "
                             f"{type(batch).__name__}")
        self._pipeline_loss = _trial_loss(train_batch)
        trial = getattr(train_batch, "__self__", None)
        if callable(getattr(trial, "pipeline_stages", None)) and not callable(getattr(model, "pipeline_stages", None)):
            raise TrialError(f"the Trial {type(trial).__name__} defines pipeline_stages, which dtrain does not read: "
                             "the stages come from distributed.pipeline.split_points or from a pipeline_stages(p) "
                             "method of the model that build_model() returns; move the method to the model")
        inputs, targets = batch
        if not isinstance(inputs, torch.Tensor):
            raise TrialError("strategy pipeline needs batches of (inputs, targets) whose inputs are one tensor "
                             f"(stage 0 takes it); the inputs were {describe_value(inputs)}")
        self._loss_scale = loss_scale
        self._losses = []
        self._release_other_stages()
        model.train()
        last = self.stage_index == self.stages - 1
        with phases.forward():
            self._prepare_schedule(inputs)
            self._compute_seconds = 0.0
            started = time.perf_counter()
            if self.stage_index == 0:
                self._schedule.step(inputs, target=targets if last else None)
            elif last:
                self._schedule.step(target=targets)
            else:
                self._schedule.step()
            if self._record is not None:  # the schedule's time this stage did not compute: waiting for the others
                self._record("bubble", max(time.perf_counter() - started - self._compute_seconds, 0.0))
        with phases.backward():
            if communicate and self.replicas > 1:
                self._average_over_replicas()
            mean = (torch.stack(self._losses).mean() if last else torch.zeros((), dtype=torch.float64)).double()
            source = dist.get_global_rank(self.pipeline_group, self.stages - 1)
            dist.broadcast(mean, src=source, group=self.pipeline_group)
        return {"loss": mean}

    def observe_waits(self, record: Callable[[str, float], None] | None) -> None:
        """Report each schedule's bubble, its wall time minus this stage's own forward, loss and
        backward compute (timed around the stage's forward_one_chunk and backward_one_chunk calls and the loss), so
        waiting for the other stages and the activations' sends and receives."""
        self._record = record

    @contextmanager
    def own_compute(self) -> Iterator[None]:
        """Time a span of this stage's own compute into the current schedule's total (outermost span only)."""
        if self.computing:
            yield
            return
        self.computing = True
        started = time.perf_counter()
        try:
            yield
        finally:
            self._compute_seconds += time.perf_counter() - started
            self.computing = False

    def consolidate(self, *, snapshot: bool = False) -> None:
        """Before a validation by `evaluate_batch`, gather the whole model; a checkpoint (`snapshot`) needs nothing,
        since each stage writes its own part."""
        if not snapshot:
            self.unwrap_model()

    def replica_part(self) -> tuple[nn.Module, int]:
        """HoldsModelParts: this rank's stage, compared with the same stage of the other replicas."""
        return self._parts[self.stage_index], self.stage_index

    def forward_in_stages(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """EvaluatesInStages: validation's forward pass with only this stage's parameters. The replica's batch is
        cut into up to m microbatches; stage 0 runs its part on each and hands the activations on (shape and dtype
        first) without waiting, so the stages overlap as in training; the last stage returns the outputs joined,
        the others None."""
        assert self._model is not None, "wrap_model() first"
        self._release_other_stages()
        part = self._parts[self.stage_index]
        previous = dist.get_global_rank(self.pipeline_group, self.stage_index - 1) if self.stage_index > 0 else None
        following = (dist.get_global_rank(self.pipeline_group, self.stage_index + 1)
                     if self.stage_index < self.stages - 1 else None)
        outputs: list[torch.Tensor] = []
        sending: list[tuple[Any, torch.Tensor]] = []  # the sends in flight, with the tensors they read
        for piece in inputs.tensor_split(max(min(self.microbatches, inputs.shape[0]), 1)):
            if previous is not None:
                piece = _receive_activation(previous, self.topology.device)
            with torch.no_grad():
                output = part(piece)
            if not isinstance(output, torch.Tensor):
                raise TrialError(f"pipeline stage {self.stage_index} of {self.stages} (modules: "
                                 f"{stage_modules(part)}) returned {describe_value(output)} in validation, not one "
                                 "tensor; cut the model with distributed.pipeline.split_points or the model's "
                                 "pipeline_stages(p) so that every stage returns one tensor")
            if following is None:
                outputs.append(output)
            else:
                sending.extend(_send_activation(output, following))
        for work, _ in sending:
            work.wait()
        return torch.cat(outputs) if following is None else None

    def model_state_dict(self) -> dict[str, Any]:
        return self.unwrap_model().state_dict()

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        self.unwrap_model().load_state_dict(state)
        self._release_other_stages()

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """One optimizer state for the whole model: each parameter's state from the rank of its stage."""
        owner = self._owner_by_index(optimizer)
        mine = optimizer.state_dict()
        states = all_gather_object(mine["state"])  # ranks d*p + s: replica 0's stages come first
        merged = {index: states[owner[index]][index] for index in owner if index in states[owner[index]]}
        return {"state": merged, "param_groups": mine["param_groups"]}

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load the whole state, then keep only this stage's part (no memory for the other stages)."""
        optimizer.load_state_dict(state)
        own = {id(p) for p in self._parts[self.stage_index].parameters()}
        for parameter in list(optimizer.state):
            if id(parameter) not in own:
                del optimizer.state[parameter]

    def save_sharded(self, folder: ShardFolder, optimizer: torch.optim.Optimizer) -> None:
        """WritesShardedCheckpoint: every rank writes its own stage (pipeline_state.save_stage); no rank gathers
        another stage."""
        assert self._model is not None, "wrap_model() first"
        save_stage(folder, self._model, self._parts[self.stage_index], optimizer)

    def load_sharded(self, folder: ShardFolder, optimizer: torch.optim.Optimizer) -> None:
        """Read back this rank's stage only (pipeline_state.load_stage)."""
        assert self._model is not None, "wrap_model() first"
        load_stage(folder, self._model, self._parts[self.stage_index], optimizer)
        self._stale = True  # the other stages' copies (when allocated) are older than this checkpoint

    # ------------------------------------------------------------------------------------- internals

    def _prepare_schedule(self, inputs: torch.Tensor) -> None:
        """Build the stage and its schedule for this microbatch shape (again when the batch size changes). The
        stage's input and output shapes are given, computed locally from the whole model on a microbatch: with
        runtime shape inference the stages' metadata exchange deadlocked on gloo (both ends sending, torch 2.13).
        Inputs and outputs that carry gradients must say so, or the stages exchange no gradients."""
        micro = inputs[: max(inputs.shape[0] // self.microbatches, 1)]
        key = (tuple(micro.shape), micro.dtype, torch.is_autocast_enabled(self.topology.device.type))
        if self._schedule is not None and key == self._schedule_key:
            return
        stage_input, stage_output = self._stage_shapes(micro)
        if self.stage_index > 0:  # activations from the previous stage carry gradients back to it
            stage_input = stage_input.detach().contiguous().requires_grad_(True)
        # contiguous: the receive buffers are made like these examples, and gloo receives into contiguous tensors only
        stage_output = stage_output.detach().contiguous().requires_grad_(True)
        stage = _TimedStage(self._parts[self.stage_index], self.stage_index, self.stages, self.topology.device,
                            input_args=(stage_input,), output_args=stage_output, group=self.pipeline_group,
                            timer=self.own_compute, microbatches=self.microbatches,
                            receives_ahead=self.receives == "ahead")
        # every stage gets the loss function: a schedule without one runs no backward pass at all
        self._schedule = SCHEDULES[self.schedule_name](stage, n_microbatches=self.microbatches, loss_fn=self._loss,
                                                       scale_grads=False)
        self._schedule_key = key

    def _stage_shapes(self, micro: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Example input and output of this rank's stage for one microbatch: the stages in turn run their own part
        on zeros of the shape and dtype the previous stage announced (a broadcast over the pipeline group)."""
        current = micro
        mine: tuple[torch.Tensor, torch.Tensor] | None = None
        for index, part in enumerate(self._parts):
            announced: list[Any] = [None]
            if index == self.stage_index:
                output, problem = _run_stage(part, current, index, self.stages, self.split_points)
                if output is not None:
                    mine = (current, output)
                    announced = [(tuple(output.shape), output.dtype)]
                else:
                    announced = [problem]
            dist.broadcast_object_list(announced, src=dist.get_global_rank(self.pipeline_group, index),
                                       group=self.pipeline_group)
            if isinstance(announced[0], str):  # every rank of the pipeline stops with the stage's own account
                raise TrialError(announced[0])
            shape, dtype = announced[0]
            current = torch.zeros(shape, dtype=dtype, device=self.topology.device)
        assert mine is not None
        return mine

    def _release_other_stages(self) -> None:
        """Free the storage of the other stages' parameters and buffers (shapes and identities stay)."""
        if self._released:
            return
        own = self._parts[self.stage_index]
        kept = {t.untyped_storage().data_ptr() for t in [*own.parameters(), *own.buffers()]}  # tied weights stay
        for tensor in self._other_tensors():
            storage = tensor.untyped_storage()
            if storage.data_ptr() in kept or storage.nbytes() == 0:
                continue
            self._released[id(tensor)] = storage.nbytes()
            storage.resize_(0)

    def _allocate_other_stages(self) -> None:
        """Give the other stages' tensors their storage back (contents follow from `_gather_stages`)."""
        for tensor in self._other_tensors():
            if id(tensor) in self._released:
                tensor.untyped_storage().resize_(self._released[id(tensor)])
        self._released = {}

    def _other_tensors(self) -> list[torch.Tensor]:
        return [tensor for index, part in enumerate(self._parts) if index != self.stage_index
                for tensor in [*part.parameters(), *part.buffers()]]

    def _loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self.own_compute():
            loss = self._pipeline_loss(outputs, targets)
            self._losses.append(loss.detach())
            return loss * (self._loss_scale / self.microbatches)

    def _average_over_replicas(self) -> None:
        """Average this stage's gradients over the replicas, one all-reduce per bucket (consecutive gradients of one
        dtype up to REPLICA_BUCKET_BYTES, copied into one flat tensor), so averaging costs one bucket's memory
        rather than a copy of the stage's gradients; a gradient as large as a bucket is reduced in place."""
        grads = [p.grad for p in self._parts[self.stage_index].parameters() if p.grad is not None]
        for bucket in gradient_buckets(grads, REPLICA_BUCKET_BYTES):
            if len(bucket) == 1 and bucket[0].is_contiguous():
                dist.all_reduce(bucket[0], group=self.data_group)
                bucket[0] /= self.replicas
                continue
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=self.data_group)
            flat /= self.replicas
            offset = 0
            for grad in bucket:
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def _gather_stages(self) -> None:
        for index, part in enumerate(self._parts):
            source = dist.get_global_rank(self.pipeline_group, index)
            for tensor in [*part.parameters(), *part.buffers()]:
                dist.broadcast(tensor.data, src=source, group=self.pipeline_group)
        self._stale = False

    def _owner_by_index(self, optimizer: torch.optim.Optimizer) -> dict[int, int]:
        """Optimizer parameter index (state_dict order: the param groups' parameters in turn) -> the global rank
        (in replica 0, rank = stage) that trains it."""
        stage_of = {id(p): s for s, part in enumerate(self._parts) for p in part.parameters()}
        ordered = [p for group in optimizer.param_groups for p in group["params"]]
        return {index: stage_of[id(p)] for index, p in enumerate(ordered) if id(p) in stage_of}


_ACTIVATION_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                      torch.int16, torch.int8, torch.uint8, torch.bool)
_MAX_DIMS = 8


def _send_activation(tensor: torch.Tensor, destination: int) -> list[tuple[Any, torch.Tensor]]:
    """Send a header (number of dimensions, shape, dtype) and then the tensor, both without waiting."""
    if tensor.dim() > _MAX_DIMS or tensor.dtype not in _ACTIVATION_DTYPES:
        raise TrialError(f"a pipeline stage's output of shape {tuple(tensor.shape)} and dtype {tensor.dtype} cannot be "
                         f"handed on in validation: at most {_MAX_DIMS} dimensions, dtypes "
                         f"{', '.join(str(d) for d in _ACTIVATION_DTYPES)}")
    header = torch.zeros(_MAX_DIMS + 2, dtype=torch.int64, device=tensor.device)
    header[0] = tensor.dim()
    header[1:1 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    header[-1] = _ACTIVATION_DTYPES.index(tensor.dtype)
    payload = tensor.contiguous()
    return [(dist.isend(header, destination), header), (dist.isend(payload, destination), payload)]


def _receive_activation(source: int, device: torch.device) -> torch.Tensor:
    """The tensor `_send_activation` sent from `source`."""
    header = torch.empty(_MAX_DIMS + 2, dtype=torch.int64, device=device)
    dist.recv(header, source)
    dims = int(header[0])
    shape = [int(n) for n in header[1:1 + dims]]
    tensor = torch.empty(shape, dtype=_ACTIVATION_DTYPES[int(header[-1])], device=device)
    dist.recv(tensor, source)
    return tensor


class _TimedStage(PipelineStage):
    """A PipelineStage whose own forward and backward passes run inside `timer()`. The schedule waits for its
    receives outside these calls, so what they time is compute. (Module hooks cannot time the first stage's
    backward: with no input that requires a gradient, a full backward hook fires before the backward pass.)

    With `receives_ahead`, the stage posts every receive of a step (the m activations from the previous stage and
    the m gradients from the next) when the schedule asks for the first one, and hands the schedule no receive of
    its own; each forward or backward waits for its microbatch's receive first. gloo's send to an unbound buffer
    is a rendezvous: when the receive is already posted, the sender's own thread writes the data at once; when it
    is not, the data waits for the receiver's notice to be handled by the sender's background thread, which on a
    busy machine may be late. Each receive has its own buffer per microbatch, and both ends keep one order per
    direction (microbatch order), which is how gloo matches them."""

    def __init__(self, *args: Any, timer: Callable[[], AbstractContextManager[None]], microbatches: int,
                 receives_ahead: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer = timer
        self._microbatches = microbatches
        self._receives_ahead = receives_ahead
        self._posted: dict[tuple[str, int], list[Any]] = {}  # ("forward" | "backward", microbatch) -> its works
        self.posted_at_first_forward = 0  # receives outstanding as the step's first forward began (for tests)

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        if not self._receives_ahead:
            return super().get_fwd_recv_ops(fwd_chunk_id)
        if fwd_chunk_id == 0:  # the first action of a step on every stage, in GPipe and in 1F1B
            self._post_step_receives()
        return []

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return [] if self._receives_ahead else super().get_bwd_recv_ops(bwd_chunk_id)

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        if fwd_chunk_id == 0:
            self.posted_at_first_forward = sum(len(works) for works in self._posted.values())
        self._wait_posted("forward", fwd_chunk_id)
        with self._timer():
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        """The stage's forward, its output made contiguous: gloo sends only contiguous tensors, and a recurrent
        layer's batch-first output is a transposed view."""
        output = super().forward_maybe_with_nosync(*args, **kwargs)
        return output.contiguous() if isinstance(output, torch.Tensor) else output

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> None:
        self._wait_posted("backward", bwd_chunk_id)
        with self._timer():
            super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    def _post_step_receives(self) -> None:
        """Post this step's receives: all activations in microbatch order, then all gradients in microbatch order
        (two directions of the pipe, each matched in its own order)."""
        if self._posted:
            raise RuntimeError(f"pipeline stage {self.stage_index}: receives of the previous step were never waited "
                               f"for ({sorted(self._posted)})")
        for direction, ops_of in (("forward", super().get_fwd_recv_ops), ("backward", super().get_bwd_recv_ops)):
            for chunk in range(self._microbatches):
                works = [op.op(op.tensor, op.peer, op.group, op.tag) for op in ops_of(chunk)]
                if works:
                    self._posted[(direction, chunk)] = works

    def _wait_posted(self, direction: str, chunk: int) -> None:
        for work in self._posted.pop((direction, chunk), []):
            work.wait()

    def backward_weight_one_chunk(self, *args: Any, **kwargs: Any) -> None:
        with self._timer():
            super().backward_weight_one_chunk(*args, **kwargs)


def describe_value(value: Any) -> str:
    """What a stage returned, in a few words: a tensor's shape and dtype, a tuple's or list's items, a dict's keys."""
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (tuple, list)):
        items = ", ".join(describe_value(item) for item in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"a {type(value).__name__} of {len(value)} ({items})"
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with keys {', '.join(repr(k) for k in list(value)[:6])}"
    return f"a {type(value).__name__}"


def stage_modules(part: nn.Module) -> str:
    """The modules a stage holds, as `name (Class)`: its top-level children, or the stage itself."""
    children = [f"{name} ({type(module).__name__})" for name, module in part.named_children()]
    return ", ".join(children) if children else type(part).__name__


def _run_stage(part: nn.Module, example: torch.Tensor, index: int, stages: int,
               split_points: Sequence[str]) -> tuple[torch.Tensor | None, str]:
    """Run stage `index` on an example microbatch (no gradient): its output, or None and the one line that says
    which stage, the modules it holds, what it returned or raised, and how to cut the model instead."""
    fix = ("cut the model so that every stage takes one tensor and returns one tensor: name the children where "
           "stages begin in distributed.pipeline.split_points, or give the model a method pipeline_stages(p) that "
           "returns the p stage modules (e.g. wrap a recurrent layer in a module that returns only its output "
           "tensor); docs/sharding.md, 'Where the model is cut'")
    where = f"pipeline stage {index} of {stages} (modules: {stage_modules(part)})"
    if split_points:
        where += f", cut at split_points {list(split_points)},"
    try:
        with torch.no_grad():
            output = part(example)
    except Exception as exc:  # the user's model code, run here first: named by its stage
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return None, (f"{where} raised {type(exc).__name__}: {text} on an input {describe_value(example)}; "
                      f"if a module before it returns more than one tensor, {fix}")
    if not isinstance(output, torch.Tensor):
        return None, f"{where} returned {describe_value(output)}, not one tensor; {fix}"
    return output, ""


def _trial_loss(train_batch: TrainBatch) -> Any:
    """The Trial's `pipeline_loss(outputs, targets)` (train_batch is the Trial's bound method)."""
    loss = getattr(getattr(train_batch, "__self__", None), "pipeline_loss", None)
    if loss is None:
        raise TrialError("strategy pipeline needs the Trial's pipeline_loss(outputs, targets) -> the mean loss of "
                         "a microbatch from the last stage's outputs; define it on the Trial")
    return loss


def build_pipeline(config: ExperimentConfig, topology: Topology) -> PipelineStrategy:
    p = config.distributed.pipeline
    return PipelineStrategy(topology, stages=p.stages, microbatches=p.microbatches, schedule=p.schedule,
                            split_points=p.split_points, receives=p.receives)


def pipeline_summary(described: Mapping[str, Any]) -> str:
    return (f"pipeline, {described.get('stages')} stages x {described.get('replicas')} replica(s), "
            f"{described.get('schedule')} with {described.get('microbatches')} microbatches (bubble "
            f"{described.get('bubble_fraction', 0.0):.0%} of a step by the formula)")


SPEC = StrategySpec("pipeline", build_pipeline, summary=pipeline_summary)
