"""dtrain plan around the formulas: recommendations, calibration fitting and files, measured models, the
published-results cases and the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dtrain.calibrate.calibrate import AllReduceFit, Calibration, ComputeMeasurement, fit_ring_alpha_beta
from dtrain.cli import main
from dtrain.commands.plan import parse_sweep
from dtrain.errors import CalibrationError
from dtrain.plan.advise import HIDDEN_SHARE, batch_for_efficiency, compression_gain, fewest_parameter_servers
from dtrain.plan.machine import compute_spec, this_machine_topology
from dtrain.plan.presets import MODELS, model_preset
from dtrain.plan.published import published_cases, published_errors, resnet101_p100_images_per_s
from dtrain.plan.spec import ComputeSpec, ModelSpec, StrategySpec, TopologySpec
from dtrain.plan.step import predict_step

REPO = Path(__file__).resolve().parents[2]
DIGITS = REPO / "tests" / "fixtures" / "digits.yaml"


def _setup() -> tuple[ModelSpec, ComputeSpec, TopologySpec, StrategySpec]:
    return (MODELS["resnet50"], ComputeSpec.from_samples_per_second(400),
            TopologySpec(devices_per_node=8, intra_bandwidth_bytes_per_s=25e9, inter_bandwidth_bytes_per_s=3.125e9,
                         inter_latency_s=1e-5), StrategySpec())


# ------------------------------------------------------------------------------------------ recommendations


def test_batch_for_efficiency_is_the_smallest_that_reaches_the_target() -> None:
    model, compute, topology, strategy = _setup()
    advice = batch_for_efficiency(model, compute, topology, strategy, 64, 0.9)
    batch = int(advice.value or 0)

    def efficiency(b: int) -> float:
        return predict_step(model, compute, topology, strategy, 64, b).scaling_efficiency

    assert efficiency(batch) >= 0.9 > efficiency(batch - 1)


def test_fewest_parameter_servers_hide_communication_and_one_fewer_does_not() -> None:
    model, compute, topology, strategy = _setup()
    topology = TopologySpec(devices_per_node=1, intra_bandwidth_bytes_per_s=12.5e9,
                            inter_bandwidth_bytes_per_s=12.5e9)  # 100 Gbit/s workers
    ps = strategy.with_(algorithm="parameter_server", server_bandwidth_bytes_per_s=1.25e9)
    advice = fewest_parameter_servers(model, compute, topology, ps, 16, 64)
    servers = int(advice.value or 0)

    def exposed(p: int) -> float:
        return predict_step(model, compute, topology, ps.with_(servers=p), 16, 64).exposed_communication_s

    limit = HIDDEN_SHARE * compute.batch_seconds(64)
    assert servers > 1 and exposed(servers) <= limit < exposed(servers - 1)


def test_no_number_of_servers_helps_when_the_worker_nic_is_the_limit() -> None:
    model, compute, topology, strategy = _setup()
    slow_workers = TopologySpec(devices_per_node=1, intra_bandwidth_bytes_per_s=1.25e8,
                                inter_bandwidth_bytes_per_s=1.25e8)
    advice = fewest_parameter_servers(model, compute, slow_workers, strategy, 8, 32)
    assert advice.value is None and "no number of servers" in advice.answer


def test_compression_helps_only_when_communication_shows() -> None:
    model, compute, topology, strategy = _setup()
    gain = compression_gain(model, compute, topology, strategy, 64, 32)
    plain = predict_step(model, compute, topology, strategy, 64, 32)
    half = predict_step(model, compute, topology, strategy.with_(compression_ratio=0.5), 64, 32)
    assert gain.value == pytest.approx(1 - half.step_s / plain.step_s) and (gain.value or 0) > 0.02
    fast = TopologySpec(devices_per_node=8, intra_bandwidth_bytes_per_s=1e12, inter_bandwidth_bytes_per_s=1e12)
    assert "does not help" in compression_gain(model, compute, fast, strategy, 64, 32).answer


# ------------------------------------------------------------------------------------------ calibration


def test_alpha_beta_fit_recovers_a_ring() -> None:
    alpha, beta = 40e-6, 0.7e-9
    points = [(s, 2 * 3 * alpha + 2 * 3 / 4 * s * beta) for s in (4096, 65536, 1 << 20, 1 << 24)]
    got = fit_ring_alpha_beta(points, 4)
    assert got == pytest.approx((alpha, beta), rel=1e-9)
    with pytest.raises(ValueError):
        fit_ring_alpha_beta(points[:1], 2)


def _calibration() -> Calibration:
    measurement = ComputeMeasurement(name="synthetic_mlp", batch=128, threads=1, forward_s=0.012, backward_s=0.024,
                                     optimizer_s=0.003, parameters=3_684_362, training_flops_per_sample=2.1e7)
    busy = ComputeMeasurement(name="reference-mlp", batch=64, threads=1, forward_s=0.01, backward_s=0.02,
                              optimizer_s=0.002, parameters=3_684_362, training_flops_per_sample=2.1e7, concurrent=2)
    fit = AllReduceFit(ranks=2, dtype="float32", alpha_s=5e-5, beta_s_per_byte=6e-10, points=[(4096, 1e-4)])
    return Calibration(machine={"cores": 2}, compute={m.key: m for m in (measurement, busy)},
                       allreduce={"float32": fit})


def test_calibration_file_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "calibration.json"
    _calibration().save(path)
    loaded = Calibration.load(path)
    assert loaded.compute == _calibration().compute
    assert loaded.compute_for("reference-mlp", 2) is not None and loaded.compute_for("synthetic_mlp", 2) is not None
    assert loaded.compute_for("reference-mlp", 2).concurrent == 2  # type: ignore[union-attr]
    assert loaded.allreduce["float32"].alpha_s == 5e-5 and loaded.allreduce["float32"].points == [(4096, 1e-4)]
    with pytest.raises(CalibrationError, match="run `dtrain plan --calibrate` first"):
        Calibration.load(tmp_path / "missing.json")
    path.write_text(json.dumps({"version": 99}))
    with pytest.raises(CalibrationError, match="cannot be read"):
        Calibration.load(path)


def test_this_machine_specs_from_a_calibration() -> None:
    calibration = _calibration()
    compute = compute_spec(calibration.compute["synthetic_mlp"])
    assert compute.seconds_per_sample == pytest.approx(0.036 / 128)
    assert compute.backward_fraction == pytest.approx(2 / 3) and compute.step_overhead_s == 0.003
    loopback = this_machine_topology(calibration.allreduce["float32"], 2)
    assert loopback.intra_bandwidth_bytes_per_s == pytest.approx(1 / 6e-10) and not loopback.shared_medium
    shaped = this_machine_topology(calibration.allreduce["float32"], 2, link_gbit_per_s=1)
    assert shaped.shared_medium and shaped.intra_bandwidth_bytes_per_s == 125e6 and shaped.intra_latency_s == 0
    assert shaped.host.seconds_per_byte == 6e-10


# --------------------------------------------------------------------------------------------- models


def test_flops_of_a_module_by_hand() -> None:
    import torch
    import torch.nn.functional as F

    from dtrain.calibrate.measure import module_model_spec

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    batch = (torch.randn(5, 8), torch.randint(0, 4, (5,)))
    spec = module_model_spec(model, batch, lambda b, m: F.cross_entropy(m(b[0]), b[1]), 5)
    assert spec.parameters == 8 * 16 + 16 + 16 * 4 + 4
    # per sample: layer 1 forward 2*8*16 + weight gradient 2*8*16 (its input needs no gradient);
    # layer 2 forward 2*16*4 + input gradient 2*16*4 + weight gradient 2*16*4
    assert spec.training_flops_per_sample == 2 * 2 * 8 * 16 + 3 * 2 * 16 * 4


def test_trial_workload_measures_the_experiment() -> None:
    from dtrain.calibrate.measure import trial_workload

    workload = trial_workload(DIGITS)
    assert workload.batch_size == 32  # global 64 over 2 slots
    model = workload.build_model()
    assert workload.parameters == sum(p.numel() for p in model.parameters())
    assert workload.training_flops_per_sample and workload.training_flops_per_sample > 0
    assert sum(workload.parameter_bytes_in_backward_order or []) == 4 * workload.parameters
    assert workload.model_spec().gradient_bytes == 4 * workload.parameters


def test_presets() -> None:
    assert model_preset("ResNet-50") is MODELS["resnet50"] and model_preset("vgg_16") is MODELS["vgg16"]
    assert MODELS["resnet50"].gradient_bytes == pytest.approx(102.2e6, rel=1e-3)
    assert MODELS["vgg16"].training_flops_per_sample == pytest.approx(6 * 15.47e9)
    with pytest.raises(KeyError, match="presets"):
        model_preset("alexnet")


# ------------------------------------------------------------------------------------------ published


def test_published_cases() -> None:
    cases = published_cases()
    errors = published_errors()
    assert set(errors) == {case.key for case in cases}
    for case in cases:
        assert case.source and case.inputs and case.assumed
        if case.scored:
            assert case.relative_error == pytest.approx((case.predicted - case.published) / case.published)
        else:
            assert errors[case.key] is None
    # interpolation between 219 (ResNet-50) and 91.8 (ResNet-152) images/s lies between them
    assert 91.8 < resnet101_p100_images_per_s() < 219


# -------------------------------------------------------------------------------------------- the CLI


def test_parse_sweep() -> None:
    assert parse_sweep("devices=1,8,...,1024") == [1, 8, 64, 512, 1024]
    assert parse_sweep("devices=1,2,...,16") == [1, 2, 4, 8, 16]
    assert parse_sweep("devices=4,1,2") == [1, 2, 4]


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    try:
        code = main(list(args))
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_prints_a_prediction_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "plan", "--model", "resnet50", "--samples-per-second", "400", "--devices", "64")
    assert code == 0
    for word in ("step", "compute", "exposed communication", "throughput", "efficiency", "bottleneck",
                 "parameter servers", "batch size", "compression"):
        assert word in out
    code, out, _ = run_cli(capsys, "plan", "--model", "vgg16", "--samples-per-second", "150", "--devices", "16",
                           "--strategy", "ps", "--servers", "4", "--json")
    payload = json.loads(out)
    assert code == 0 and payload["prediction"]["devices"] == 16
    assert payload["prediction"]["bottleneck"].startswith("communication")
    assert {r["topic"] for r in payload["recommendations"]} == {"parameter servers", "batch size", "compression"}


def test_plan_gives_hsdps_memory_and_the_bytes_it_keeps_inside_a_node(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "plan", "--model", "resnet50", "--samples-per-second", "400", "--devices", "32",
                           "--devices-per-node", "8", "--json")
    memory = json.loads(out)["memory"]
    per_rank = memory["model_state_bytes_per_rank"]
    assert code == 0 and memory["hsdp_shard_ranks"] == 8
    assert per_rank["hsdp"] == pytest.approx(4 * per_rank["fsdp"])  # sharded over 8 ranks, not 32
    sent = memory["sent_bytes_per_rank_per_step"]
    assert sent["hsdp"]["across_nodes"] < sent["ddp"]["across_nodes"] / 8 and sent["fsdp"]["within_node"] == 0
    code, out, _ = run_cli(capsys, "plan", "--model", "resnet50", "--samples-per-second", "400", "--devices", "32",
                           "--devices-per-node", "8")
    assert "hsdp" in out and "sent per rank per step (within a node / across nodes" in out


def test_plan_sweep_writes_a_png(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "curve.png"
    code, out, _ = run_cli(capsys, "plan", "--model", "bert-large", "--device-tflops", "100", "--sweep",
                           "devices=1,8,...,64", "--plot", str(png), "--json")
    payload = json.loads(out)
    assert code == 0 and [p["devices"] for p in payload["predictions"]] == [1, 8, 64]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    efficiencies = [p["scaling_efficiency"] for p in payload["predictions"]]
    assert efficiencies[0] == 1.0 and all(0 < e <= 1 for e in efficiencies)


@pytest.mark.parametrize(("args", "message"), [
    (("plan", "--samples-per-second", "5"), "name the model"),
    (("plan", "--model", "alexnet", "--samples-per-second", "5"), "unknown model preset 'alexnet'"),
    (("plan", "--model", "vgg16"), "give one device's speed"),
    (("plan", "--model", "vgg16", "--samples-per-second", "-1"), "--samples-per-second -1.0 must be > 0"),
    (("plan", "--model", "vgg16", "--samples-per-second", "9", "--sweep", "batch=1,2"), "--sweep 'batch=1,2'"),
    (("plan", "--model", "vgg16", "--samples-per-second", "9", "--compression-ratio", "2"), "compression_ratio"),
    (("plan", "--model", "vgg16", "--samples-per-second", "9", "--link-gbit", "1"), "use it with --this-machine"),
    (("plan", "--model", "vgg16", "--parameters", "5", "--samples-per-second", "9"), "both name the model"),
    (("plan", "--this-machine", "--model", "vgg16", "--calibration", "/nonexistent/c.json"), "no calibration at"),
])
def test_bad_plan_invocations_are_one_line(capsys: pytest.CaptureFixture[str], args: tuple[str, ...],
                                           message: str) -> None:
    code, out, err = run_cli(capsys, *args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("dtrain: error:"), err
    assert message in lines[0] and "Traceback" not in err + out


def test_plan_with_this_machine(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "calibration.json"
    _calibration().save(path)
    code, out, _ = run_cli(capsys, "plan", "--this-machine", "--calibration", str(path), "--parameters", "3684362",
                           "--flops-per-sample", "2.1e7", "--devices", "2", "--batch-per-device", "128",
                           "--link-gbit", "1", "--json")
    prediction = json.loads(out)["prediction"]
    # compute at the FLOP rate the reference reached with 2 processes at once: 2.1e7 * 64 / 0.03 FLOP/s
    assert code == 0 and prediction["compute_s"] == pytest.approx(0.03 * 128 / 64)
    assert prediction["bottleneck"] == "communication: intra-node bandwidth"


def test_plan_module_imports_no_torch() -> None:
    code = ("import sys, dtrain.plan, dtrain.plan.advise, dtrain.plan.published, dtrain.commands.plan; "
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
