"""`dtrain plan`: the command-line face of the performance model, and of the calibration that feeds it."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from dtrain.calibrate.measure import REFERENCE_WORKLOAD
from dtrain.errors import ExitCode, PlanError
from dtrain.plan.spec import ComputeSpec, ModelSpec, StrategySpec, TopologySpec
from dtrain.plan.units import gbit_per_s_to_bytes_per_s, mib_to_bytes, microseconds_to_seconds

STRATEGIES = {"ring": "ring", "tree": "tree", "halving-doubling": "halving_doubling",
              "hierarchical": "hierarchical", "ps": "parameter_server", "parameter-server": "parameter_server"}


DESCRIPTION = """Predict the step time, throughput and scaling efficiency of synchronous data parallelism
before the cluster exists, split into compute and the communication that does not hide behind backward, name
the bottleneck, and recommend parameter servers, batch size and compression. The model: alpha-beta costs of
ring / tree / halving-doubling / hierarchical all-reduce or parameter servers, DDP-style gradient buckets
pipelined with backward, compression and aggregation_frequency (docs/tools.md, "dtrain plan")."""

EPILOG = """examples:
  dtrain plan --model resnet50 --samples-per-second 400 --devices 64 --inter-gbit 25
  dtrain plan --model vgg16 --samples-per-second 150 --sweep devices=1,8,...,1024 --plot vgg16.png
  dtrain plan --calibrate --config examples/synthetic_mlp/mlp.yaml
  dtrain plan --this-machine --config examples/synthetic_mlp/mlp.yaml --devices 2 --link-gbit 1

Bandwidths are in Gbit/s (decimal), latencies in microseconds. Without --this-machine, give the per-device
compute (--samples-per-second, or --device-tflops with --utilization)."""


def register(subcommands: Any) -> argparse.ArgumentParser:
    """Add `dtrain plan` and its options, in groups: model, compute, batch, topology, strategy, machine, output."""
    plan = subcommands.add_parser("plan", help="predict step time and scaling before the cluster exists",
                               description=DESCRIPTION, epilog=EPILOG,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    model = plan.add_argument_group("model (one of)")
    model.add_argument("--model", help="preset: resnet50, resnet101, resnet152, vgg16, bert-large")
    model.add_argument("--config", type=Path, help="an experiment YAML: measure its Trial's model (parameters, "
                                                   "FLOPs, gradient buckets), batch and workers")
    model.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a key of --config, as in `dtrain run`")
    model.add_argument("--parameters", type=float, help="parameter count (e.g. 25.6e6)")
    model.add_argument("--flops-per-sample", type=float, help="training FLOPs (forward + backward) per sample")
    model.add_argument("--bytes-per-parameter", type=int, default=4, help="gradient element size (default 4)")

    compute = plan.add_argument_group("per-device compute (one of)")
    compute.add_argument("--samples-per-second", type=float, help="one device's training throughput")
    compute.add_argument("--device-tflops", type=float, help="one device's peak TFLOP/s (needs FLOPs per sample)")
    compute.add_argument("--utilization", type=float, default=0.4,
                         help="achieved fraction of --device-tflops (default 0.4)")
    compute.add_argument("--backward-fraction", type=float, default=2 / 3,
                         help="share of compute in backward, the window communication can hide in (default 2/3)")
    compute.add_argument("--step-overhead-ms", type=float, default=0.0,
                         help="fixed cost per step that does not shrink with the batch (optimizer; default 0)")

    batch = plan.add_argument_group("batch (one of)")
    batch.add_argument("--batch-per-device", type=int, help="samples per device per step (default 32, or "
                                                            "--config's)")
    batch.add_argument("--global-batch", type=int, help="samples per step over all devices (split evenly)")

    topo = plan.add_argument_group("topology")
    topo.add_argument("--devices", type=int, help="devices (workers) in all (default 8, or --config's slots)")
    topo.add_argument("--devices-per-node", type=int, default=None, help="devices per node (default 8)")
    topo.add_argument("--intra-gbit", type=float, default=200.0,
                      help="link between devices of a node, Gbit/s (default 200, PCIe 4.0 x16 class)")
    topo.add_argument("--intra-latency-us", type=float, default=5.0, help="per message step (default 5)")
    topo.add_argument("--inter-gbit", type=float, default=25.0, help="each node's network link, Gbit/s "
                                                                     "(default 25)")
    topo.add_argument("--inter-latency-us", type=float, default=10.0, help="per message step (default 10)")
    topo.add_argument("--shared-medium", action="store_true",
                      help="links are one queue for all ranks and both directions (hub, shaped loopback)")

    strat = plan.add_argument_group("strategy")
    strat.add_argument("--strategy", choices=sorted(STRATEGIES), default="ring", help="default ring")
    strat.add_argument("--inter-node-algorithm", choices=["ring", "tree", "halving-doubling"], default="ring",
                       help="between nodes, for --strategy hierarchical (default ring)")
    strat.add_argument("--servers", type=int, default=1, help="parameter servers, for --strategy ps (default 1)")
    strat.add_argument("--server-gbit", type=float, help="each parameter server's link (default --inter-gbit)")
    strat.add_argument("--compression-ratio", type=float, default=1.0,
                       help="bytes sent / fp32 gradient bytes (fp16 0.5, top-1%% about 0.02; default 1)")
    strat.add_argument("--compression", choices=["none", "fp16"], default="none",
                       help="fp16: ratio 0.5 (with --this-machine, the host cost of fp16_compress_hook as calibrated)")
    strat.add_argument("--device-speeds", metavar="LIST",
                       help="relative speeds of the devices, e.g. 1,0.5 (one per device): predict the even split "
                            "against the speed-proportional one of distributed.heterogeneous")
    strat.add_argument("--averaging-period", type=int, metavar="H",
                       help="local SGD: predict averaging every H updates instead of every step")
    strat.add_argument("--no-overlap", action="store_true", help="communicate only after backward ends")
    strat.add_argument("--aggregation-frequency", type=int, help="batches per synchronization (default 1, or "
                                                                 "--config's)")
    strat.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket MiB (default 25, DDP's)")
    strat.add_argument("--first-bucket-mb", type=float, default=1.0,
                       help="cap of the bucket backward fills first (default 1, as dtrain's "
                            "optimizations.first_bucket_mb and plain DDP; DDP given bucket_cap_mb uses --bucket-mb)")

    machine = plan.add_argument_group("this machine")
    machine.add_argument("--calibrate", action="store_true",
                         help="measure this machine (compute per sample of a reference MLP and of --config's Trial, "
                              "alone and with --devices processes at once (default: one per core); gloo all-reduce "
                              "alpha and beta for fp32 and for fp16 with fp16_compress_hook's casts) and save it to "
                              "--calibration")
    machine.add_argument("--calibration", type=Path,
                         help="calibration file (default $DTRAIN_CALIBRATION or ~/.cache/dtrain/calibration.json)")
    machine.add_argument("--this-machine", action="store_true",
                         help="predict this machine's workers from the calibration: compute, loopback speed and "
                              "the CPU cost of communication")
    machine.add_argument("--link-gbit", type=float,
                         help="with --this-machine: the loopback shaped to this rate (benchmarks/netem.py)")
    machine.add_argument("--threads", type=int, default=1, help="threads per worker when calibrating (default 1)")

    memory = plan.add_argument_group("memory per rank (ZeRO, FSDP, pipeline)")
    memory.add_argument("--optimizer-state", choices=["adam", "sgd-momentum", "sgd", "zero-paper"], default="adam",
                        help="bytes per parameter: adam 4+4+8 (dtrain: fp32 weights and gradients), sgd-momentum "
                             "4+4+4, sgd 4+4+0, zero-paper 2+2+12 (the ZeRO paper's mixed-precision Adam); default "
                             "adam")
    memory.add_argument("--device-memory-gb", type=float,
                        help="memory of one device (GB, 1e9 bytes): recommend the least-sharded layout that fits")
    memory.add_argument("--stages", type=int, default=2, help="pipeline stages p for the bubble (default 2)")
    memory.add_argument("--microbatches", type=int, default=4, help="pipeline microbatches m (default 4)")

    losing = plan.add_argument_group("losing workers (an elastic job that keeps its global batch)")
    losing.add_argument("--lose", type=int, metavar="K", help="what losing K of the --devices workers costs: the step "
                        "time at the new size and the time to recover (restart + checkpoint load + the steps redone "
                        "since the last checkpoint)")
    losing.add_argument("--checkpoint-period", type=int, metavar="STEPS",
                        help="steps between checkpoints (default --config's min_checkpoint_period in batches, "
                             "else 100)")
    losing.add_argument("--restart-s", type=float, default=30.0,
                        help="seconds to restart the survivors: processes, rendezvous, imports (default 30)")
    losing.add_argument("--checkpoint-read-gbit", type=float, default=8.0,
                        help="rate each worker reads the checkpoint at, Gbit/s (default 8, a local NVMe class)")

    out = plan.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print JSON instead of text")
    out.add_argument("--sweep", metavar="devices=LIST",
                     help="a scaling curve over device counts, e.g. devices=1,8,64 or devices=1,8,...,1024 (the "
                          "'...' continues the geometric series and ends at the last value)")
    out.add_argument("--plot", type=Path, help="PNG of the sweep (default plan-sweep.png)")
    out.add_argument("--target-efficiency", type=float, default=0.9,
                     help="efficiency the batch-size recommendation aims at (default 0.9)")
    plan.set_defaults(handler=run_plan)
    return plan


# ------------------------------------------------------------------------------------------- parsing


def parse_sweep(text: str) -> list[int]:
    """`devices=1,8,64` or `devices=1,8,...,1024` (geometric continuation, ending exactly at the last value)."""
    name, _, values = text.partition("=")
    if name.strip() != "devices" or not values:
        raise PlanError(f"--sweep {text!r} is not understood; write --sweep devices=1,8,64 or devices=1,8,...,1024")
    items = [item.strip() for item in values.split(",") if item.strip()]
    try:
        if "..." in items:
            at = items.index("...")
            head, tail = [int(x) for x in items[:at]], [int(x) for x in items[at + 1:]]
            if len(head) < 2 or len(tail) != 1 or head[1] <= head[0]:
                raise ValueError
            ratio, series = head[1] / head[0], list(head)
            while series[-1] * ratio < tail[0]:
                series.append(round(series[-1] * ratio))
            counts = [*series, tail[0]]
        else:
            counts = [int(x) for x in items]
    except ValueError:
        raise PlanError(f"--sweep {text!r}: give whole device counts, e.g. devices=1,8,...,1024 (two values "
                        "before '...', one after)") from None
    if not counts or min(counts) < 1:
        raise PlanError(f"--sweep {text!r}: device counts must be >= 1")
    return sorted(set(counts))


def _positive(name: str, value: float | None) -> None:
    if value is not None and not value > 0:
        raise PlanError(f"{name} {value} must be > 0")


def _load_calibration(args: argparse.Namespace) -> Any:
    from dtrain.calibrate.calibrate import Calibration, default_calibration_path

    return Calibration.load(args.calibration or default_calibration_path())


def _model_from_args(args: argparse.Namespace) -> tuple[ModelSpec, dict[str, Any]]:
    """The model, and what --config says about batch, workers and aggregation."""
    from dtrain.plan.presets import model_preset

    given = [name for name, value in (("--model", args.model), ("--config", args.config),
                                      ("--parameters", args.parameters)) if value is not None]
    if len(given) > 1:
        raise PlanError(f"{' and '.join(given)} both name the model; give one")
    if args.model:
        try:
            return model_preset(args.model), {}
        except KeyError as exc:
            raise PlanError(str(exc).strip("'\"")) from None
    if args.parameters is not None:
        _positive("--parameters", args.parameters)
        return ModelSpec(name="model", parameters=int(args.parameters), training_flops_per_sample=args.flops_per_sample,
                         bytes_per_parameter=args.bytes_per_parameter, source="given"), {}
    if args.config is not None:
        from dtrain.calibrate.measure import trial_workload
        from dtrain.config import load_config

        workload = trial_workload(args.config, args.overrides, args.batch_per_device)
        config = load_config(args.config, args.overrides).config
        facts = {"devices": config.resources.world_size, "batch_per_device": workload.batch_size,
                 "aggregation_frequency": config.optimizations.aggregation_frequency, "workload": workload,
                 "checkpoint_period": config.min_checkpoint_period.batches or None}
        return workload.model_spec(), facts
    raise PlanError("name the model: --model resnet50 (presets: resnet50, resnet101, resnet152, vgg16, bert-large), "
                    "--config EXPERIMENT.yaml, or --parameters N")


def _compute_from_args(args: argparse.Namespace, model: ModelSpec, calibration: Any, workers_per_node: int
                       ) -> ComputeSpec:
    common = {"backward_fraction": args.backward_fraction, "step_overhead_s": args.step_overhead_ms / 1e3}
    if args.samples_per_second is not None:
        _positive("--samples-per-second", args.samples_per_second)
        return ComputeSpec.from_samples_per_second(args.samples_per_second, source="given", **common)
    if args.device_tflops is not None:
        _positive("--device-tflops", args.device_tflops)
        if not 0 < args.utilization <= 1:
            raise PlanError(f"--utilization {args.utilization} must be in (0, 1]")
        if model.training_flops_per_sample is None:
            raise PlanError("--device-tflops needs the model's FLOPs per sample: give --flops-per-sample, a preset "
                            "or --config")
        return ComputeSpec.from_flops(model, args.device_tflops * 1e12, args.utilization, source="given", **common)
    if calibration is not None:
        from dtrain.plan.machine import compute_spec, compute_spec_from_flops

        measured = calibration.compute_for(model.name, workers_per_node)
        if measured is not None:
            return compute_spec(measured)
        if model.training_flops_per_sample is None:
            raise PlanError(f"the calibration has no measurement of {model.name} and its FLOPs are unknown; "
                            f"run `dtrain plan --calibrate --config ...` for it or give --samples-per-second")
        reference = calibration.compute_for(REFERENCE_WORKLOAD, workers_per_node)
        if reference is None:
            raise PlanError("the calibration has no reference measurement; run `dtrain plan --calibrate` again")
        return compute_spec_from_flops(model.training_flops_per_sample, reference)
    raise PlanError("give one device's speed: --samples-per-second N, or --device-tflops T (with FLOPs per sample), "
                    "or --this-machine after `dtrain plan --calibrate`")


def _topology_from_args(args: argparse.Namespace, calibration: Any) -> TopologySpec:
    for name in ("intra_gbit", "inter_gbit", "server_gbit", "link_gbit"):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    if calibration is not None:
        from dtrain.plan.machine import this_machine_topology

        dtype = "float16" if args.compression == "fp16" else "float32"
        fit = calibration.allreduce.get(dtype) or calibration.allreduce["float32"]
        workers = args.devices_per_node or calibration.machine.get("cores", 1)
        return this_machine_topology(fit, workers, link_gbit_per_s=args.link_gbit)
    if args.link_gbit is not None:
        raise PlanError("--link-gbit describes this machine's shaped loopback; use it with --this-machine "
                        "(or --intra-gbit/--inter-gbit for a cluster)")
    return TopologySpec(devices_per_node=args.devices_per_node or 8,
                        intra_bandwidth_bytes_per_s=gbit_per_s_to_bytes_per_s(args.intra_gbit),
                        intra_latency_s=microseconds_to_seconds(args.intra_latency_us),
                        inter_bandwidth_bytes_per_s=gbit_per_s_to_bytes_per_s(args.inter_gbit),
                        inter_latency_s=microseconds_to_seconds(args.inter_latency_us),
                        shared_medium=args.shared_medium, source="given")


def _strategy_from_args(args: argparse.Namespace, facts: dict[str, Any], calibration: Any) -> StrategySpec:
    ratio = 0.5 if args.compression == "fp16" else args.compression_ratio
    try:
        return StrategySpec(
            algorithm=STRATEGIES[args.strategy], inter_node_algorithm=args.inter_node_algorithm.replace("-", "_"),
            servers=args.servers,
            server_bandwidth_bytes_per_s=gbit_per_s_to_bytes_per_s(args.server_gbit) if args.server_gbit else None,
            compression_ratio=ratio, overlap=not args.no_overlap,
            aggregation_frequency=args.aggregation_frequency or facts.get("aggregation_frequency", 1),
            bucket_bytes=mib_to_bytes(args.bucket_mb),
            first_bucket_bytes=mib_to_bytes(min(args.first_bucket_mb, args.bucket_mb)))
    except ValueError as exc:
        raise PlanError(str(exc)) from None


# ------------------------------------------------------------------------------------------- running


def run_plan(args: argparse.Namespace) -> int:
    if args.calibrate:
        return _calibrate(args)
    calibration = _load_calibration(args) if args.this_machine else None
    model, facts = _model_from_args(args)
    topology = _topology_from_args(args, calibration)
    workers = min(args.devices or facts.get("devices", 8), topology.devices_per_node)
    compute = _compute_from_args(args, model, calibration, workers)
    strategy = _strategy_from_args(args, facts, calibration)
    if args.batch_per_device is not None and args.global_batch is not None:
        raise PlanError("--batch-per-device and --global-batch both set the batch; give one")
    _positive("--batch-per-device", args.batch_per_device)
    _positive("--global-batch", args.global_batch)
    if not 0 < args.target_efficiency < 1:
        raise PlanError(f"--target-efficiency {args.target_efficiency} must be between 0 and 1")
    from dtrain.plan.advise import advise
    from dtrain.plan.report import describe_setup, format_prediction, format_sweep, plot_sweep
    from dtrain.plan.step import per_device_batch_for, predict_step, sweep_devices

    per_device = args.batch_per_device
    if per_device is None and args.global_batch is None:
        per_device = facts.get("batch_per_device", 32)
    header = describe_setup(model, compute, topology, strategy)
    if args.sweep and args.lose is not None:
        raise PlanError("--lose answers for one --devices count; drop --sweep (or --lose)")
    if args.sweep:
        counts = parse_sweep(args.sweep)
        predictions = sweep_devices(model, compute, topology, strategy, counts, per_device_batch=per_device,
                                    global_batch=args.global_batch)
        path = plot_sweep(predictions, args.plot or Path("plan-sweep.png"), header.replace("\n", "\n"))
        if args.json:
            print(json.dumps({"setup": header, "predictions": [p.to_dict() for p in predictions],
                              "plot": str(path)}, indent=2))
        else:
            print(header + "\n" + format_sweep(predictions) + f"\n  plot: {path}")
        return ExitCode.OK
    devices = args.devices or facts.get("devices", 8)
    _positive("--devices", devices)
    batch = per_device_batch_for(devices, per_device_batch=per_device, global_batch=args.global_batch)
    prediction = predict_step(model, compute, topology, strategy, devices, batch)
    advice = advise(model, compute, topology, strategy, devices, batch, args.target_efficiency)
    memory, memory_text = _memory(args, model, devices, topology.devices_in_a_node(devices))
    uneven, uneven_text = _uneven(args, prediction, devices)
    losing, losing_text = _losing(args, facts, (model, compute, topology, strategy), prediction)
    if args.json:
        print(json.dumps({"setup": header, "prediction": prediction.to_dict(),
                          "recommendations": [vars(a) for a in advice], "memory": memory, **uneven, **losing},
                         indent=2))
    else:
        print(header + "\n" + format_prediction(prediction, advice) + "\n" + memory_text + uneven_text + losing_text)
    return ExitCode.OK


def _losing(args: argparse.Namespace, facts: dict[str, Any], setup: tuple[Any, Any, Any, Any], prediction: Any
            ) -> tuple[dict[str, Any], str]:
    """--lose K: the step time after losing K workers and the time to recover (dtrain.plan.losing)."""
    from dtrain.plan.losing import RecoveryAssumptions, cost_of_losing, format_loss_cost

    if args.lose is None:
        return {}, ""
    devices = prediction.devices
    if not 1 <= args.lose < devices:
        raise PlanError(f"--lose {args.lose} of {devices} workers: give 1 <= K < --devices (one must survive)")
    period = args.checkpoint_period if args.checkpoint_period is not None else facts.get("checkpoint_period") or 100
    _positive("--checkpoint-period", period)
    _positive("--checkpoint-read-gbit", args.checkpoint_read_gbit)
    if args.restart_s < 0:
        raise PlanError(f"--restart-s {args.restart_s} must be >= 0")
    assumptions = RecoveryAssumptions(restart_s=args.restart_s, checkpoint_period_steps=period,
                                      checkpoint_read_bytes_per_s=gbit_per_s_to_bytes_per_s(args.checkpoint_read_gbit),
                                      optimizer_state=args.optimizer_state)
    cost = cost_of_losing(*setup, devices, args.lose, prediction.global_batch, assumptions, before=prediction)
    return {"losing": cost.to_dict()}, "\n" + format_loss_cost(cost)


def _uneven(args: argparse.Namespace, prediction: Any, devices: int) -> tuple[dict[str, Any], str]:
    """--device-speeds and --averaging-period: the uneven-cluster lines (dtrain.plan.uneven)."""
    from dtrain.plan.uneven import format_local_sgd, format_uneven, local_sgd_step_seconds, predict_uneven

    out: dict[str, Any] = {}
    text = ""
    if args.device_speeds:
        try:
            relative = [float(x) for x in args.device_speeds.split(",")]
        except ValueError:
            raise PlanError(f"--device-speeds {args.device_speeds!r}: give numbers, e.g. 1,0.5") from None
        if len(relative) != devices or min(relative) <= 0:
            raise PlanError(f"--device-speeds has {len(relative)} value(s) for {devices} devices; give one positive "
                            "relative speed per device")
        per_device = prediction.per_device_batch / prediction.compute_s  # records/s of a speed-1 device
        uneven = predict_uneven(prediction.global_batch, [v * per_device for v in relative])
        out["uneven"] = uneven.to_dict()
        text += "\n" + format_uneven(uneven)
    if args.averaging_period:
        _positive("--averaging-period", args.averaging_period)
        step = local_sgd_step_seconds(prediction.compute_s, prediction.communication_s, args.averaging_period)
        out["local_sgd"] = {"period": args.averaging_period, "step_s": step}
        text += "\n" + format_local_sgd(prediction.compute_s, prediction.exposed_communication_s,
                                        prediction.communication_s, args.averaging_period)
    return out, text


def _memory(args: argparse.Namespace, model: Any, devices: int, per_node: int) -> tuple[dict[str, Any], str]:
    """Model-state bytes per rank for each layout (hsdp sharded over the `per_node` ranks of a node), the bytes a
    rank sends per step under the data-parallel layouts, the pipeline bubble, and the layout that fits a device."""
    from dtrain.plan.memory import bubble_fraction, model_state_bytes, recommend_layout, step_traffic

    parameters = model.parameters

    _positive("--device-memory-gb", args.device_memory_gb)
    if args.stages < 2 or args.microbatches < 1:
        raise PlanError(f"--stages {args.stages} must be >= 2 and --microbatches {args.microbatches} >= 1")
    layouts = {layout: model_state_bytes(parameters, layout, devices, args.optimizer_state).total_bytes
               for layout in ("ddp", "zero1", "zero2", "fsdp")}
    shard = per_node if devices % per_node == 0 else devices
    layouts["hsdp"] = model_state_bytes(parameters, "hsdp", devices, args.optimizer_state,
                                        shard_ranks=shard).total_bytes
    traffic = {layout: step_traffic(model.gradient_bytes, layout, devices, shard) for layout in ("ddp", "fsdp", "hsdp")}
    if devices % args.stages == 0:
        layouts[f"pipeline{args.stages}"] = model_state_bytes(parameters, "ddp", devices // args.stages,
                                                              args.optimizer_state, stages=args.stages).total_bytes
    bubble = bubble_fraction(args.stages, args.microbatches)
    info: dict[str, Any] = {"optimizer_state": args.optimizer_state, "model_state_bytes_per_rank": layouts,
                            "hsdp_shard_ranks": shard,
                            "sent_bytes_per_rank_per_step": {layout: {"within_node": t.within_node_bytes,
                                                                      "across_nodes": t.across_nodes_bytes}
                                                             for layout, t in traffic.items()},
                            "pipeline": {"stages": args.stages, "microbatches": args.microbatches,
                                         "bubble_fraction": bubble}}
    lines = [f"memory per rank ({devices} ranks, {args.optimizer_state}): " + ", ".join(
        f"{name}{' (not built)' if name == 'zero2' else ''} {value / 1e9:.3g} GB" for name, value in layouts.items()),
        f"  pipeline bubble at p={args.stages}, m={args.microbatches}: {bubble:.1%} of a step idle",
        f"  sent per rank per step (within a node / across nodes; hsdp sharded over {shard} ranks): " + ", ".join(
            f"{layout} {t.within_node_bytes / 1e9:.3g} / {t.across_nodes_bytes / 1e9:.3g} GB"
            for layout, t in traffic.items())]
    if args.device_memory_gb is not None:
        chosen, _ = recommend_layout(parameters, devices, args.device_memory_gb * 1e9, args.optimizer_state)
        info["recommended_layout"] = chosen
        lines.append(f"  fits {args.device_memory_gb:g} GB per device: " + (
            f"distributed.strategy {chosen if chosen != 'ddp' else 'allreduce'}" if chosen else
            f"no layout over {devices} ranks (model state alone; add ranks)"))
    return info, "\n".join(lines)


def _calibrate(args: argparse.Namespace) -> int:
    from dtrain.calibrate.calibrate import (
        Calibration,
        default_calibration_path,
        machine_facts,
        measure_allreduce,
        measure_compute_concurrently,
    )

    path = args.calibration or default_calibration_path()
    say = lambda text: print(f"dtrain plan: {text}", file=sys.stderr)  # noqa: E731
    busy = args.devices or int(machine_facts()["cores"] or 1)
    compute = {}
    for config in [None, args.config] if args.config is not None else [None]:
        for processes in sorted({1, busy}):
            what = "the reference MLP" if config is None else str(config)
            say(f"timing a training step of {what} on {args.threads} thread(s), {processes} process(es) at once ...")
            measured = measure_compute_concurrently(config, args.overrides, batch=args.batch_per_device,
                                                    processes=processes, threads=args.threads)
            compute[measured.key] = measured
    ranks = max(busy, 2)
    allreduce = {}
    for dtype in ("float32", "float16"):
        say(f"timing gloo all-reduce of {dtype} between {ranks} processes on 127.0.0.1 ...")
        allreduce[dtype] = measure_allreduce(dtype=dtype, ranks=ranks)
    calibration = Calibration(machine=machine_facts(), compute=compute, allreduce=allreduce)
    calibration.save(path)
    if args.json:
        print(json.dumps(calibration.to_json(), indent=2))
        return ExitCode.OK
    for name, m in compute.items():
        rate = f", {m.achieved_flops_per_s / 1e9:.1f} GFLOP/s" if m.achieved_flops_per_s else ""
        print(f"compute     {name} (batch {m.batch}): {m.seconds_per_sample * 1e3:.3f} ms per sample (backward "
              f"{m.backward_fraction:.0%}), optimizer {m.optimizer_s * 1e3:.2f} ms per step{rate}")
    for dtype, fit in allreduce.items():
        bandwidth = "inf" if math.isinf(fit.bandwidth_bytes_per_s) else f"{fit.bandwidth_bytes_per_s / 1e9:.2f}"
        print(f"all-reduce  {dtype}: alpha {fit.alpha_s * 1e6:.1f} us, beta {bandwidth} GB/s ({fit.ranks} ranks)")
    print(f"saved       {path}")
    return ExitCode.OK


__all__ = ["parse_sweep", "register", "run_plan"]
