"""Experiment config: parsing, overrides, Determined compatibility and one-line errors that name the key."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from dtrain.config import (
    ExperimentConfig,
    Length,
    check_buildable,
    dump_config,
    load_config,
    parse_override,
)
from dtrain.errors import ConfigError, ExitCode

REPO = Path(__file__).resolve().parents[2]

BASE: dict[str, Any] = {
    "name": "t",
    "entrypoint": "model_def:MyTrial",
    "hyperparameters": {"global_batch_size": 64, "learning_rate": 0.1},
    "resources": {"slots_per_trial": 2},
    "searcher": {"name": "single", "metric": "accuracy", "max_length": {"batches": 10}},
}


def config_with(**changes: Any) -> dict[str, Any]:
    raw = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        node = raw
        parts = dotted.split("__")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        if value is _DELETE:
            node.pop(parts[-1])
        else:
            node[parts[-1]] = value
    return raw


_DELETE = object()


def test_examples_parse() -> None:
    for name in ("const.yaml", "distributed.yaml"):
        loaded = load_config(REPO / "examples" / "fashion_mnist" / name)
        assert loaded.config.global_batch_size == 256
        assert loaded.config.searcher.max_length == Length(epochs=8)
        assert loaded.warnings == []
    assert load_config(REPO / "examples" / "fashion_mnist" / "distributed.yaml").config.resources.world_size == 2


def test_defaults_follow_determined() -> None:
    config = load_config(None, raw=BASE).config
    assert config.max_restarts == 5
    assert config.optimizations.aggregation_frequency == 1
    assert config.optimizations.average_aggregated_gradients is True
    assert config.min_validation_period == Length(batches=0)
    assert config.records_per_epoch == 0
    assert config.searcher.smaller_is_better is True
    assert config.distributed.strategy == "allreduce"


def test_resolved_config_round_trips() -> None:
    config = load_config(None, raw=BASE).config
    again = load_config(None, raw=yaml.safe_load(dump_config(config))).config
    assert again == config


@pytest.mark.parametrize(("text", "key", "value"), [
    ("resources.slots_per_trial=4", "resources.slots_per_trial", 4),
    ("hyperparameters.learning_rate=0.05", "hyperparameters.learning_rate", 0.05),
    ("optimizations.average_aggregated_gradients=false", "optimizations.average_aggregated_gradients", False),
    ("name=run 7", "name", "run 7"),
    ("searcher.max_length={batches:60}", "searcher.max_length", {"batches": 60}),
    ("searcher.max_length={epochs: 2}", "searcher.max_length", {"epochs": 2}),
])
def test_override_values_get_types(text: str, key: str, value: Any) -> None:
    assert parse_override(text) == (key, value)


def test_overrides_apply_and_coerce() -> None:
    loaded = load_config(None, ["resources.slots_per_trial=4", "hyperparameters.global_batch_size=128",
                                "name=123", "min_validation_period={epochs: 1}"], raw=BASE)
    assert loaded.config.resources.slots_per_trial == 4
    assert loaded.config.global_batch_size == 128
    assert loaded.config.name == "123"
    assert loaded.config.min_validation_period == Length(epochs=1)


def test_const_hyperparameters_are_unwrapped() -> None:
    raw = config_with(hyperparameters__learning_rate={"type": "const", "val": 0.3})
    assert load_config(None, raw=raw).config.hyperparameters["learning_rate"] == 0.3


def test_determined_cluster_keys_warn_and_run() -> None:
    raw = config_with(environment={"image": "x"}, resources__resource_pool="gpu", bind_mounts=[])
    loaded = load_config(None, raw=raw)
    joined = " ".join(loaded.warnings)
    assert "`environment`" in joined and "`resources.resource_pool`" in joined and "`bind_mounts`" in joined


def test_remainder_is_dropped_with_a_warning() -> None:
    loaded = load_config(None, raw=config_with(hyperparameters__global_batch_size=65))
    assert any("65" in w and "dropped" in w and "64" in w for w in loaded.warnings)


def test_lengths_convert_to_batches() -> None:
    assert Length(batches=7).to_batches(64, 0) == 7
    assert Length(records=640).to_batches(64, 0) == 10
    assert Length(records=650).to_batches(64, 0) == 11
    assert Length(epochs=2).to_batches(100, 1000) == 20
    with pytest.raises(ConfigError, match="records_per_epoch"):
        Length(epochs=1).to_batches(64, 0)


# Each bad config and a piece of text its single error line must contain (the offending key).
BAD_CONFIGS: list[tuple[str, dict[str, Any], str]] = [
    ("unknown top-level key", config_with(max_restart=3), "`max_restart`"),
    ("unknown key suggests the closest", config_with(searcher__max_lenght={"batches": 1}), "searcher.max_length"),
    ("unknown section key", config_with(resources__slot_per_trial=2), "resources.slots_per_trial"),
    ("missing entrypoint", config_with(entrypoint=_DELETE), "`entrypoint`"),
    ("missing searcher", config_with(searcher=_DELETE), "`searcher`"),
    ("missing max_length", config_with(searcher__max_length=_DELETE), "searcher.max_length"),
    ("missing global batch", config_with(hyperparameters__global_batch_size=_DELETE), "global_batch_size"),
    ("global batch below world", config_with(hyperparameters__global_batch_size=1), "global_batch_size"),
    ("global batch not an int", config_with(hyperparameters__global_batch_size="big"), "global_batch_size"),
    ("slots not a number", config_with(resources__slots_per_trial="two"), "resources.slots_per_trial"),
    ("negative restarts", config_with(max_restarts=-1), "max_restarts"),
    ("length with two units", config_with(searcher__max_length={"batches": 1, "epochs": 1}), "searcher.max_length"),
    ("bad strategy name", config_with(distributed={"strategy": "alreduce"}), "distributed.strategy"),
    ("bad op", config_with(distributed={"op": "mean"}), "distributed.op"),
    ("bad searcher name", config_with(searcher__name="bayes"), "searcher.name"),
    ("bad compression name", config_with(distributed={"compression": {"name": "zip"}}), "distributed.compression.name"),
    ("compression option of another compressor", config_with(distributed={"compression": {"name": "fp16",
                                                                                            "ratio": 0.1}}),
     "distributed.compression.ratio"),
    ("topk ratio above 1", config_with(distributed={"compression": {"name": "topk", "ratio": 2}}),
     "distributed.compression.ratio"),
    ("qsgd levels beyond a byte", config_with(distributed={"compression": {"name": "qsgd", "levels": 255}}),
     "distributed.compression.levels"),
    ("powersgd start_iter 1", config_with(distributed={"compression": {"name": "powersgd", "start_iter": 1}}),
     "distributed.compression.start_iter"),
    ("two compressions", config_with(optimizations={"gradient_compression": True},
                                     distributed={"compression": {"name": "topk"}}),
     "optimizations.gradient_compression"),
    ("compression with adasum", config_with(distributed={"op": "adasum", "compression": {"name": "fp16"}}),
     "distributed.op"),
    ("data loader workers negative", config_with(data_loader={"num_workers": -2}), "data_loader.num_workers"),
    ("search space without searcher", config_with(hyperparameters__learning_rate={"type": "double", "minval": 0.1,
                                                                                    "maxval": 1}),
     "hyperparameters.learning_rate"),
    ("aggregation frequency zero", config_with(optimizations={"aggregation_frequency": 0}),
     "optimizations.aggregation_frequency"),
    ("bool that is not", config_with(perform_initial_validation="sometimes"), "perform_initial_validation"),
    ("checkpoint policy", config_with(checkpoint_policy="often"), "checkpoint_policy"),
    ("section given as a list", config_with(resources=[1, 2]), "resources"),
    ("unknown optimizer", config_with(large_batch={"optimizer": "lamb2"}), "large_batch.optimizer"),
    ("option of another optimizer", config_with(large_batch={"optimizer": "adam", "trust_coefficient": 0.01}),
     "large_batch.trust_coefficient"),
    ("optimizer option with the Trial's optimizer", config_with(large_batch={"momentum": 0.9}), "large_batch.momentum"),
    ("no base rate", config_with(hyperparameters__learning_rate=_DELETE, large_batch={"optimizer": "sgd"}),
     "large_batch.base_lr"),
    ("base rate not a number", config_with(hyperparameters__learning_rate="fast", large_batch={"optimizer": "sgd"}),
     "hyperparameters.learning_rate"),
    ("scaling without a base batch", config_with(large_batch={"lr_scaling": "linear"}), "large_batch.base_batch_size"),
    ("warm-up without scaling", config_with(large_batch={"warmup_epochs": 2}), "large_batch.warmup_epochs"),
    ("unknown decay", config_with(large_batch={"decay": "exponential"}), "large_batch.decay.name"),
    ("step decay without milestones", config_with(large_batch={"decay": "step"}), "large_batch.decay"),
    ("decay inside warm-up", config_with(large_batch={"lr_scaling": "sqrt", "base_batch_size": 32, "warmup_epochs": 5,
                                                      "decay": {"name": "step", "milestones": [3]}}),
     "large_batch.decay.milestones"),
    ("betas out of range", config_with(large_batch={"optimizer": "lamb", "betas": [0.9, 1.5]}), "large_batch.betas"),
    ("weight decay hyperparameter negative", config_with(hyperparameters__weight_decay=-0.1,
                                                         large_batch={"optimizer": "sgd"}),
     "hyperparameters.weight_decay"),
    ("weight decay hyperparameter not a number", config_with(hyperparameters__weight_decay="lots",
                                                             large_batch={"optimizer": "lamb"}),
     "hyperparameters.weight_decay"),
    ("nested option of another optimizer", config_with(large_batch={"optimizer": "sgd", "eps": 1e-6}),
     "large_batch.eps"),
    ("compression given as a bare unknown name", config_with(distributed={"compression": "zip"}),
     "distributed.compression.name"),
    ("batch schedule factor 1", config_with(large_batch={"batch_size_schedule": {"epochs": [2], "factor": 1}}),
     "large_batch.batch_size_schedule"),
    ("batch schedule epochs unsorted", config_with(large_batch={"batch_size_schedule": {"epochs": [4, 2]}}),
     "large_batch.batch_size_schedule"),
    ("backup workers without sync", config_with(distributed={"strategy": "parameter_server", "parameter_server": {
        "mode": "async", "backup_workers": 1}}), "distributed.parameter_server.backup_workers"),
    ("timeline window backwards", config_with(profiling={"begin_on_batch": 5, "end_after_batch": 3}),
     "profiling.end_after_batch"),
    ("decay milestones unsorted", config_with(large_batch={"decay": {"name": "step", "milestones": [4, 2]}}),
     "large_batch.decay.milestones"),
    ("kill during checkpoint off rank 0",
     config_with(faults={"kills": [{"rank": 1, "batch": 2, "during": "checkpoint"}]}), "faults.kills.0"),
]


@pytest.mark.parametrize(("why", "raw", "named"), BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_bad_config_names_the_key(why: str, raw: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, raw=raw)
    message = str(caught.value)
    assert named in message, message
    assert "\n" not in message
    assert "Traceback" not in message


# A key in backticks (where pydantic located the problem), then after the colon that key again, in full or by its
# last part: "`profiling`: profiling.end_after_batch ...", "`large_batch.betas`: betas [0.9, 1.5] ...".
_KEY_TWICE = re.compile(r"^`((?:[a-z0-9_]+\.)*([a-z_][a-z0-9_]*))`[^:]*: (?:\1|\2)(?![a-z0-9_])")


@pytest.mark.parametrize(("why", "raw", "named"), BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_bad_config_names_its_key_once(why: str, raw: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, raw=raw)
    assert not _KEY_TWICE.match(str(caught.value)), str(caught.value)


@pytest.mark.parametrize(("raw", "message"), [
    (config_with(distributed={"strategy": "parameter_server", "parameter_server": {"mode": "async",
                                                                                    "backup_workers": 1}}),
     "distributed.parameter_server.backup_workers (1) applies to mode `sync` only (mode `async` never waits for all "
     "workers); remove it or set `mode: sync`"),
    (config_with(distributed={"compression": {"name": "fp16", "ratio": 0.1}}),
     "distributed.compression.ratio (0.1) applies to topk, not to `fp16`; remove it or change "
     "distributed.compression.name"),
    (config_with(profiling={"begin_on_batch": 5, "end_after_batch": 3}),
     "profiling.end_after_batch (3) must be >= profiling.begin_on_batch (5); raise it or leave it out to profile to "
     "the end"),
], ids=["backup_workers", "compression ratio", "end_after_batch"])
def test_rule_message_gives_key_once_value_rule_and_fix(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, raw=raw)
    assert str(caught.value) == message


def test_hyperparameter_rules_stop_dtrain_run_before_any_worker_starts(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The weight decay a named optimizer takes from the hyperparameters is checked when the file loads (it was
    checked in each worker, after launch)."""
    from dtrain.cli import main
    from tests.conftest import FIXTURES

    launched: list[Any] = []
    monkeypatch.setattr("dtrain.launch.launch_workers", lambda *args: launched.append(args))
    code = main(["run", str(FIXTURES / "digits.yaml"), "--run-dir", str(tmp_path / "run"), "--set",
                 "large_batch.optimizer=sgd", "--set", "hyperparameters.weight_decay=-0.1"])
    assert code == ExitCode.USER_ERROR and not launched
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["dtrain: error: hyperparameters.weight_decay (-0.1) is the weight decay of large_batch.optimizer "
                   "`sgd` and must be a number >= 0; fix it or set large_batch.weight_decay (from --set)"], err


def test_compression_and_optimizer_sections_take_their_defaults_and_short_forms() -> None:
    config = load_config(None, raw=config_with(distributed={"compression": "powersgd"},
                                               large_batch={"optimizer": "lars", "momentum": 0.8})).config
    assert config.distributed.compression.options() == {"rank": 4, "start_iter": 10, "min_compression_rate": 2.0,
                                                        "error_feedback": True, "warm_start": True, "seed": 0}
    assert config.large_batch.optimizer_options() == {"momentum": 0.8, "trust_coefficient": 0.001,
                                                      "exclude_bias_and_norm": True}
    assert load_config(None, raw=config_with(distributed={"compression": {}})).config.compression.name == "none"
    assert load_config(None, raw=config_with(large_batch={})).config.large_batch.optimizer == "trial"


def test_unknown_key_message_suggests_fix() -> None:
    with pytest.raises(ConfigError, match=r"did you mean `searcher.max_length`\?"):
        load_config(None, raw=config_with(searcher__max_lenght={"batches": 1}))


def test_bad_override_is_attributed() -> None:
    with pytest.raises(ConfigError, match=r"from --set"):
        load_config(None, ["resources.slot_per_trial=2"], raw=BASE)
    with pytest.raises(ConfigError, match="dotted.key=value"):
        load_config(None, ["resources.slots_per_trial"], raw=BASE)
    with pytest.raises(ConfigError, match="not a section"):
        load_config(None, ["name.first=x"], raw=BASE)
    with pytest.raises(ConfigError, match=r"^profiling.end_after_batch \(1\) .* to the end \(from --set\)$"):
        load_config(None, ["profiling.begin_on_batch=4", "profiling.end_after_batch=1"], raw=BASE)


def test_yaml_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\nentrypoint: x:Y\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_config(broken)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just a string\n")
    with pytest.raises(ConfigError, match="not a mapping"):
        load_config(scalar)


def test_unbuilt_features_are_refused_by_name() -> None:
    config = load_config(None, raw=config_with(optimizations={"mixed_precision": "O3"})).config
    with pytest.raises(ConfigError, match="optimizations.mixed_precision"):
        check_buildable(config)
    check_buildable(load_config(None, raw=BASE).config)


def test_compression_is_buildable_and_determined_flag_means_fp16() -> None:
    from dtrain.compress import REGISTRY, build_compressor

    config = load_config(None, raw=config_with(optimizations={"gradient_compression": True})).config
    check_buildable(config)
    assert config.compression.name == "fp16"
    raw = config_with(distributed={"compression": {"name": "topk", "ratio": 0.01, "warmup_steps": 100}})
    config = load_config(None, raw=raw).config
    check_buildable(config)
    compressor = build_compressor(config.compression.name, **config.compression.options())
    assert compressor.describe() == {"name": "topk", "ratio": 0.01, "error_feedback": True, "warmup_steps": 100,
                                     "warmup_start_ratio": 0.25}
    for name in REGISTRY:
        check_buildable(load_config(None, raw=config_with(distributed={"compression": {"name": name}})).config)


def test_large_batch_recipes_are_buildable() -> None:
    raw = config_with(large_batch={"optimizer": "lamb", "lr_scaling": "sqrt", "base_batch_size": 32,
                                   "warmup_epochs": 1.5, "decay": {"name": "cosine", "final_fraction": 0.01},
                                   "max_grad_norm": 1.0, "batch_size_schedule": {"epochs": [3, 6], "factor": [2, 4],
                                                                                 "max_per_slot_batch": 64}})
    config = load_config(None, raw=raw).config
    check_buildable(config)
    assert config.large_batch.decay.name == "cosine" and config.large_batch.batch_size_schedule is not None
    assert config.large_batch.batch_size_schedule.factors == [2, 4]
    assert load_config(None, raw=config_with(large_batch={"decay": "cosine"})).config.large_batch.schedules_lr


def test_experiment_config_is_strict_about_types() -> None:
    with pytest.raises(ConfigError, match=r"`resources.slots_per_trial` = 2.5 must be an integer"):
        load_config(None, raw=config_with(resources__slots_per_trial=2.5))
    assert load_config(None, raw=config_with(name=7)).config.name == "7"  # a number given for a string
    config = load_config(None, raw=BASE).config
    with pytest.raises(ValidationError):  # assignments are validated too, as in the file
        config.resources.slots_per_trial = "two"  # type: ignore[assignment]
    with pytest.raises(ValidationError):
        config.max_restarts = -1
    assert isinstance(config, ExperimentConfig) and config.resources.slots_per_trial == 2


@pytest.mark.parametrize(("setting", "once"), [
    ({"checkpoint_storage": {"type": "hdfs"}}, "directory, shared_fs, s3, gcs, azure"),
    ({"distributed": {"compression": {"name": "zzz"}}}, "none, fp16"),
])
def test_a_value_that_is_none_of_the_choices_lists_them_once(setting: dict[str, Any], once: str) -> None:
    raw = {"entrypoint": "m:T", "hyperparameters": {"global_batch_size": 8},
           "searcher": {"max_length": {"batches": 1}}, **setting}
    with pytest.raises(ConfigError) as caught:
        load_config(None, raw=raw)
    message = str(caught.value)
    assert message.count(once) == 1 and "must be one of" in message and "\n" not in message, message
