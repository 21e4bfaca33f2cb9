"""The bad-input corpus: malformed experiment files, command lines, data files and checkpoints. Each must get
exactly one `dtrain: error:` line that says what is wrong, a non-zero exit code, no traceback, and must leave
every file that existed before unchanged.

Config and command-line cases run `dtrain.cli.main` in this process (they fail before any worker starts;
a case that reached the launcher would fail the test). Data and checkpoint cases run `dtrain.worker.main`
in this process as a one-worker run, the same code `dtrain run` starts in each worker; one checkpoint case
goes through a whole `dtrain run`. Errors that only running workers meet (corpus/worker_error_trial.py) go
through a whole `dtrain run` with restarts allowed: each must end it without the restarts that cannot help.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from faultkit import CONFIG, FIXTURES, dtrain, error_lines, summary

from dtrain import cli, worker
from dtrain.train import checkpoint as ckpt

pytestmark = pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # @record under capture

CORPUS = Path(__file__).resolve().parent / "corpus"
CONFIGS = sorted((CORPUS / "configs").glob("*.yaml"))
UNREADABLE = {"binary.yaml": "cannot be read (UnicodeDecodeError)"}


# A resume records its invocation in the run's own config.yaml (fault keys may change) and run.json, and a
# failed attempt appends to the logs; everything else must stay as it was.
RUN_METADATA = {"config.yaml", "run.json"}


def snapshot(root: Path) -> dict[str, str]:
    """SHA-256 of every file under root, except a run's logs and metadata (see RUN_METADATA)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and "logs" not in p.relative_to(root).parts
            and not (p.name in RUN_METADATA and (p.parent / "checkpoints").is_dir())}


def assert_one_clear_error(code: int, stderr: str, expected: str) -> None:
    assert code != 0
    assert "Traceback" not in stderr, stderr
    lines = error_lines(stderr)
    assert len(lines) == 1, stderr
    assert expected in lines[0], lines[0]
    assert len(lines[0]) < 600, "one line, not a dump"


def expectation(config: Path) -> str:
    if config.name in UNREADABLE:
        return UNREADABLE[config.name]
    first = config.read_text().splitlines()[0]
    assert first.startswith("# expect: "), f"{config.name} must say what it expects on its first line"
    return first.removeprefix("# expect: ")


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        pytest.fail("a bad input reached the launcher")

    monkeypatch.setattr("dtrain.launch.launch_workers", refuse)


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_malformed_config(config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_launch: None) -> None:
    before = snapshot(CORPUS)
    code = cli.main(["run", str(config), "--run-dir", str(tmp_path / "run")])
    assert_one_clear_error(code, capsys.readouterr().err, expectation(config))
    assert snapshot(CORPUS) == before
    assert not (tmp_path / "run").exists()


def _existing_run(root: Path, status: str) -> Path:
    run = root / "existing"
    run.mkdir()
    config = yaml.safe_load(CONFIG.read_text())
    config["entrypoint"] = str(FIXTURES / "digits_trial.py") + ":DigitsTrial"
    from dtrain.config import dump_config, load_config

    (run / "config.yaml").write_text(dump_config(load_config(None, raw=config).config))
    (run / "summary.json").write_text(json.dumps({"status": status}))
    return run


# (arguments after `dtrain`, with {config} and {tmp} filled in; what the error line must say)
CLI_CASES: dict[str, tuple[list[str], str]] = {
    "run-without-config": (["run"], "the following arguments are required: config"),
    "config-does-not-exist": (["run", "{tmp}/nowhere.yaml"],
                              "does not exist; give the path of an experiment YAML"),
    "config-is-a-directory": (["run", "{tmp}"], "cannot be read (IsADirectoryError)"),
    "unknown-flag": (["run", "{config}", "--gpus", "2"], "unrecognized arguments: --gpus 2"),
    "set-without-equals": (["run", "{config}", "--set", "resources.slots_per_trial"],
                           "must look like dotted.key=value"),
    "set-unknown-key": (["run", "{config}", "--set", "resources.slot=2"],
                        "unknown config key `resources.slot` (value 2) in section `resources`"),
    "set-into-a-value": (["run", "{config}", "--set", "max_restarts.count=2"], "`max_restarts` is 2, not a section"),
    "set-wrong-type": (["run", "{config}", "--set", "scheduling_unit=often"],
                       "`scheduling_unit` = 'often' (from --set)"),
    "nnodes-zero": (["run", "{config}", "--nnodes", "0"], "--nnodes 0 must be >= 1"),
    "node-rank-outside": (["run", "{config}", "--nnodes", "2", "--node-rank", "2", "--master-port", "29999"],
                          "--node-rank 2 must be in [0, 1]"),
    "multinode-without-address": (["run", "{config}", "--nnodes", "2"],
                                  "give the chief's --master-addr and --master-port"),
    "port-out-of-range": (["run", "{config}", "--master-port", "70000"], "--master-port 70000 must be a TCP port"),
    "nnodes-not-a-number": (["run", "{config}", "--nnodes", "two"],
                            "--nnodes 'two': give a number of nodes N or a range MIN:MAX of whole numbers"),
    "nnodes-range-reversed": (["run", "{config}", "--nnodes", "3:2", "--master-port", "29999"],
                              "--nnodes 3:2: MIN (3) must not exceed MAX (2): the job runs on MIN to MAX nodes; write "
                              "--nnodes 2:3"),
    "nnodes-range-from-zero": (["run", "{config}", "--nnodes", "0:2"], "--nnodes 0:2: MIN must be >= 1"),
    "nnodes-range-uneven": (["run", "{config}", "--nnodes", "1:3", "--master-port", "29999"],
                            "resources.slots_per_trial (2) must be a multiple of MAX in --nnodes 1:3"),
    "nnodes-range-with-servers": (["run", "{config}", "--nnodes", "1:2", "--master-port", "29999", "--set",
                                   "distributed.strategy=parameter_server"],
                                  "--nnodes 1:2: strategy parameter_server cannot change size while it runs"),
    "run-dir-not-a-run": (["run", "{config}", "--run-dir", "{tmp}/occupied"],
                          "exists and is not empty but holds no dtrain run"),
    "run-dir-completed": (["run", "{config}", "--run-dir", "{tmp}/existing"],
                          "holds a completed run; give a new --run-dir"),
    "run-dir-other-config": (["run", "{config}", "--set", "hyperparameters.learning_rate=0.2", "--run-dir",
                              "{tmp}/existing"], "holds a run with a different config"),
    "show-unknown-experiment": (["experiments", "show", "999"], "no run store at"),
    "unknown-command": (["train", "{config}"], "invalid choice: 'train'"),
    "diagnose-too-few-steps": (["diagnose", "{config}", "--steps", "3", "--out", "{tmp}/diagnosis"],
                               "--steps 3 is too short to time"),
    "diagnose-no-repeats": (["diagnose", "{config}", "--repeats", "0", "--out", "{tmp}/diagnosis"],
                            "--repeats 0: the trials run at least once"),
}


@pytest.mark.parametrize("name", list(CLI_CASES))
def test_malformed_command_line(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                no_launch: None) -> None:
    args, expected = CLI_CASES[name]
    (tmp_path / "occupied").mkdir()
    (tmp_path / "occupied" / "notes.txt").write_text("mine")
    _existing_run(tmp_path, "completed" if name == "run-dir-completed" else "stopped")
    before = snapshot(tmp_path)
    filled = [a.replace("{config}", str(CONFIG)).replace("{tmp}", str(tmp_path)) for a in args]
    try:
        code = cli.main(filled)
    except SystemExit as exc:  # argparse exits itself
        code = int(exc.code or 0)
    assert_one_clear_error(code, capsys.readouterr().err, expected)
    assert snapshot(tmp_path) == before


# ----------------------------------------------------------------------------------------- data files


def _idx(magic_dims: tuple[int, ...], payload: bytes) -> bytes:
    dims = magic_dims[1:]
    return struct.pack(">I", magic_dims[0]) + struct.pack(f">{len(dims)}I", *dims) + payload


def _fashion_files(directory: Path, *, images: int = 8, side: int = 28, labels: int = 8,
                   image_magic: int = 0x803) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for split in ("train", "t10k"):
        image_bytes = _idx((image_magic, images, side, side), bytes(images * side * side))
        label_bytes = _idx((0x801, labels), bytes(labels))
        (directory / f"{split}-images-idx3-ubyte.gz").write_bytes(gzip.compress(image_bytes))
        (directory / f"{split}-labels-idx1-ubyte.gz").write_bytes(gzip.compress(label_bytes))


def _truncated(directory: Path) -> None:
    _fashion_files(directory)
    path = directory / "train-images-idx3-ubyte.gz"
    path.write_bytes(gzip.compress(gzip.decompress(path.read_bytes())[:-100]))


def _not_gzip(directory: Path) -> None:
    _fashion_files(directory)
    (directory / "train-labels-idx1-ubyte.gz").write_bytes(b"this is not gzip data at all")


DATA_CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    "data-directory-missing": (lambda d: None, "Fashion-MNIST's four IDX files are not in"),
    "data-truncated-images": (_truncated, "train-images-idx3-ubyte.gz"),
    "data-wrong-magic": (lambda d: _fashion_files(d, image_magic=0x801), "train-images-idx3-ubyte.gz"),
    "data-labels-and-images-disagree": (lambda d: _fashion_files(d, labels=5), "train"),
    "data-not-gzip": (_not_gzip, "train-labels-idx1-ubyte.gz"),
    "data-wrong-image-size": (lambda d: _fashion_files(d, side=10), "expected N x 28 x 28 images and N labels"),
}


def _one_worker_config(root: Path, **changes: object) -> Path:
    config = yaml.safe_load(CONFIG.read_text())
    config.update({"entrypoint": str(FIXTURES / "digits_trial.py") + ":DigitsTrial", "max_restarts": 0,
                   "resources": {"slots_per_trial": 1}, **changes})
    path = root / "experiment.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("name", list(DATA_CASES))
def test_malformed_data_file(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make, expected = DATA_CASES[name]
    data_dir = tmp_path / "data"
    make(data_dir)
    config = _one_worker_config(tmp_path, entrypoint=str(CORPUS / "fashion_trial.py") + ":FashionFromDirectory",
                                data={"directory": str(data_dir)})
    before = snapshot(tmp_path)
    code = worker.main([str(config), "--run-dir", str(tmp_path / "run")])
    assert_one_clear_error(code, capsys.readouterr().err, expected)
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before
    assert not (tmp_path / "run" / "checkpoints").exists()


# ---------------------------------------------------------------------------------------- checkpoints


def _rewrite_meta(ref: ckpt.CheckpointRef) -> None:
    """Make meta.json agree with whatever the data files now hold (a forged, 'valid' checkpoint)."""
    meta = json.loads((ref.path / ckpt.META_FILE).read_text())
    for name in (ckpt.MODEL_FILE, ckpt.STATE_FILE):
        data = (ref.path / name).read_bytes()
        meta["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (ref.path / ckpt.META_FILE).write_text(json.dumps(meta))


class _Exploit:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("arbitrary code ran while loading a checkpoint",))


def _pickle_with_code(ref: ckpt.CheckpointRef) -> None:
    buffer = io.BytesIO()
    torch.save({"weight": _Exploit()}, buffer)
    (ref.path / ckpt.MODEL_FILE).write_bytes(buffer.getvalue())
    _rewrite_meta(ref)


def _other_model(ref: ckpt.CheckpointRef) -> None:
    torch.save({"encoder.weight": torch.zeros(3)}, ref.path / ckpt.MODEL_FILE)
    _rewrite_meta(ref)


def _flip_byte(ref: ckpt.CheckpointRef) -> None:
    path = ref.path / ckpt.STATE_FILE
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))


def _latest_outside(ref: ckpt.CheckpointRef) -> None:
    shutil.copytree(ref.path, ref.path.parents[2] / "elsewhere")  # a complete checkpoint, outside checkpoints/
    shutil.rmtree(ref.path)
    (ref.path.parent / "latest").write_text("../../elsewhere\n")


CHECKPOINT_CASES: dict[str, tuple[Callable[[ckpt.CheckpointRef], None], str]] = {
    "checkpoint-corrupt-and-no-other": (_flip_byte, "no usable checkpoint"),
    "checkpoint-truncated": (lambda r: (r.path / ckpt.STATE_FILE).write_bytes(b"PK\x03\x04"),
                             "does not match its checksum"),
    "checkpoint-meta-garbage": (lambda r: (r.path / ckpt.META_FILE).write_text("{not json"), "meta.json is unreadable"),
    "checkpoint-latest-points-outside": (_latest_outside, "not a checkpoint name like step-100"),
    "checkpoint-with-code-in-its-pickle": (_pickle_with_code, "cannot be loaded (UnpicklingError"),
    "checkpoint-of-another-model": (_other_model, "does not fit this Trial's model"),
}


@pytest.fixture(scope="module")
def one_worker_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-worker run stopped after batch 4 with its checkpoint, to be damaged by each case."""
    root = tmp_path_factory.mktemp("ckpt")
    config = _one_worker_config(root, min_checkpoint_period={"batches": 0})
    code = worker.main([str(config), "--run-dir", str(root / "run"), "--set", "faults.stop_after_batch=4"])
    assert code == 0
    assert (root / "run" / "checkpoints" / "step-4").is_dir()
    return root


@pytest.mark.parametrize("name", list(CHECKPOINT_CASES))
def test_malformed_checkpoint(name: str, one_worker_checkpoint: Path, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    damage, expected = CHECKPOINT_CASES[name]
    shutil.copytree(one_worker_checkpoint, tmp_path / "case")
    run_dir = tmp_path / "case" / "run"
    damage(ckpt.CheckpointRef(run_dir / "checkpoints" / "step-4", 4))
    capsys.readouterr()
    before = snapshot(run_dir)
    code = worker.main([str(tmp_path / "case" / "experiment.yaml"), "--run-dir", str(run_dir)])
    captured = capsys.readouterr()
    assert_one_clear_error(code, captured.err, expected)
    assert "arbitrary code ran" not in captured.out + captured.err
    after = snapshot(run_dir)
    assert {k: v for k, v in after.items() if k in before} == before, [k for k in before if after.get(k) != before[k]]


@pytest.mark.slow  # starts `dtrain run` two or more times
def test_corrupt_checkpoint_through_dtrain_run(tmp_path: Path) -> None:
    """The whole path: `dtrain run` on a run dir whose only checkpoint is corrupt stops with one line and
    exit code 2, without restarting the workers, and leaves the checkpoint as it was."""
    run_dir = tmp_path / "run"
    stopped = dtrain("run", CONFIG, "--set", "faults.stop_after_batch=5", "--run-dir", run_dir)
    assert stopped.returncode == 3, stopped.stderr
    _flip_byte(ckpt.CheckpointRef(run_dir / "checkpoints" / "step-5", 5))
    before = snapshot(run_dir / "checkpoints")
    result = dtrain("run", CONFIG, "--run-dir", run_dir)
    assert result.returncode == 2
    assert_one_clear_error(result.returncode, result.stderr, "no usable checkpoint in")
    assert snapshot(run_dir / "checkpoints") == before
    assert "restart" not in (run_dir / "logs" / "rank-0.log").read_text().lower()


# ------------------------------------------------------------------------ errors found inside the workers

WORKER_TRIALS = CORPUS / "worker_error_trial.py"


@dataclass(frozen=True)
class WorkerCase:
    """An error that only a running worker meets, run through a whole `dtrain run` with restarts allowed."""

    trial: str  # a class of corpus/worker_error_trial.py
    settings: tuple[str, ...]  # --set key=value, {tmp} filled in
    expected: str  # in the one error line
    starts: int  # worker starts: 1 for an error dtrain names, 2 for an exception in user code (it must come back)


WORKER_CASES = {
    "renamed-hyperparameter": WorkerCase("RenamedHyperparameter", (), "hyperparameter `lr` is not in the config's "
                                         "hyperparameters; defined: global_batch_size, learning_rate", 1),
    "dict-batches-under-pipeline": WorkerCase("DictBatches", ("distributed.strategy=pipeline",),
                                              "strategy pipeline needs batches of (inputs, targets); the batch was "
                                              "dict", 1),
    "user-exception-at-batch-3": WorkerCase("FailsAtBatch3", (), "KeyError: 'cooldown' in train_batch "
                                            "(worker_error_trial.py:51) after 2 batches, again after a restart", 2),
    "data-missing-on-one-rank": WorkerCase("DataOnEachNode", ("data.directory={tmp}/node-{{rank}}",),
                                           "Fashion-MNIST's four IDX files are not in {tmp}/node-1", 1),
}


def worker_starts(run_dir: Path) -> int:
    """How many times the elastic agent started the workers: it keeps a log directory per attempt."""
    return len(list((run_dir / "logs" / "agent").glob("*/attempt_*")))


@pytest.mark.parametrize("name", list(WORKER_CASES))
def test_error_inside_the_workers_stops_without_restarts(name: str, tmp_path: Path) -> None:
    """max_restarts 3, yet an error that a restart cannot mend ends the run at once: one line (and, for an
    exception in user code, its user frames once), exit code 2, none of torch's agent lines on the console."""
    case = WORKER_CASES[name]
    _fashion_files(tmp_path / "node-0", images=200, labels=200)
    settings = [s.format(tmp=tmp_path) for s in case.settings]
    run_dir = tmp_path / "run"
    result = dtrain("run", CONFIG, "--set", f"entrypoint={WORKER_TRIALS}:{case.trial}", "--set", "max_restarts=3",
                    *(arg for setting in settings for arg in ("--set", setting)), "--run-dir", run_dir)
    assert result.returncode == 2, result.stderr[-3000:]
    assert worker_starts(run_dir) == case.starts, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    [error] = error_lines(result.stderr)
    assert case.expected.format(tmp=tmp_path) in error, error
    restarts = [line for line in lines if "restarting the workers" in line]
    starting = [line for line in lines if line.startswith("digits_test: starting")]
    shown = [line for line in lines if line.startswith("Traceback")]
    if case.starts == 1:
        assert not shown and not restarts, result.stderr
        # the run dir, the trainer's first line when the error came after it, the error
        assert len(lines) == 2 + len(starting) and len(starting) <= 1, result.stderr
    else:  # the exception once, then the restart that met it again
        assert len(restarts) == 1 and "after 2 batches; restarting the workers" in restarts[0], result.stderr
        assert len(shown) == 1 and "the user's frames only" in shown[0], result.stderr
        traceback = lines[lines.index(shown[0]):lines.index(error)]
        assert "worker_error_trial.py" in traceback[1] and traceback[-1] == "KeyError: 'cooldown'", traceback
        assert not [line for line in traceback if "/dtrain/" in line or "site-packages" in line], traceback
        # the run dir, a start line per attempt, the restart, the traceback (header, frame, code, markers, last)
        assert len(lines) == 1 + len(starting) + 1 + len(traceback) + 1 and len(starting) == 2, result.stderr
    assert "exitcode" not in result.stderr and "[rank" not in result.stderr  # torch's lines went to the log
    # the agent names the first worker it found failed: the one with the error, or a peer that saw it go first
    assert "failed (exitcode: " in (run_dir / "logs" / "agent.log").read_text()
    assert summary(run_dir)["status"] == "failed"
