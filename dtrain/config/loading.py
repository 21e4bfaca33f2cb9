"""Experiment YAML -> validated config: read the file, apply `--set` overrides, drop Determined's cluster keys,
validate, and turn any rule violation into one `ConfigError` line."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from dtrain.config.experiment import ExperimentConfig
from dtrain.config.ignored import drop_ignored_keys
from dtrain.config.messages import explain
from dtrain.errors import ConfigError


@dataclass
class LoadedConfig:
    """A validated config with the warnings met while loading it (printed once by the caller)."""

    config: ExperimentConfig
    source: Path | None
    warnings: list[str] = field(default_factory=list)

    @property
    def base_dir(self) -> Path:
        """Directory of the YAML file: relative entrypoints and data paths start here."""
        return self.source.parent.resolve() if self.source else Path.cwd()

def parse_override(text: str) -> tuple[str, Any]:
    """Split `dotted.key=value`; the value is read as YAML so that 4, true, 0.1 and [1, 2] get their types."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"--set {text!r} must look like dotted.key=value; write e.g. "
                          "`--set resources.slots_per_trial=4`")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
        if _has_unspaced_colon(value):  # `{batches:60}` is YAML for {"batches:60": null}; mean {batches: 60}
            value = yaml.safe_load(re.sub(r":(?=\S)", ": ", raw))
    except yaml.YAMLError:
        value = raw
    return key, value


def _has_unspaced_colon(value: Any) -> bool:
    return isinstance(value, dict) and any(isinstance(k, str) and ":" in k and v is None for k, v in value.items())


def apply_override(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set `key` (dotted) in a raw config dict, creating the sections on the way."""
    parts = key.split(".")
    node = raw
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise ConfigError(f"--set {key}=...: `{where}` is {child!r}, not a section, so it has no key "
                              f"`{parts[depth + 1]}`; set `{where}` itself")
        node = child
    node[parts[-1]] = value


def read_yaml(path: Path) -> dict[str, Any]:
    """Read an experiment file with yaml.safe_load; the top level must be a mapping."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; give the path of an experiment YAML file") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} cannot be read ({exc.__class__.__name__}); "
                          "give the path of a readable YAML text file") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"config file {path} is not valid YAML{where}: {problem}; fix the syntax there") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} holds a {type(raw).__name__}, not a mapping of keys; "
                          "it must start with keys such as `name:` and `entrypoint:`")
    return raw


def load_config(path: str | Path | None, overrides: Iterable[str] = (), raw: dict[str, Any] | None = None
                ) -> LoadedConfig:
    """Read, override and validate an experiment config; raise `ConfigError` with one line on any problem."""
    source = Path(path) if path is not None else None
    if raw is not None:
        data = copy.deepcopy(raw)
    elif source is not None:
        data = read_yaml(source)
    else:
        raise ValueError("load_config needs the path of an experiment file or its raw mapping")
    _refuse_old_fault_section(data, "")
    override_keys = []
    for text in overrides:
        key, value = parse_override(text)
        if key.split(".")[0] == "debug" and "." in key:
            _refuse_old_fault_section({"debug": {}}, f" (--set {key})")
        apply_override(data, key, value)
        override_keys.append(key)
    warnings = drop_ignored_keys(data)
    try:
        config = ExperimentConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(explain(exc, override_keys)) from None
    return LoadedConfig(config=config, source=source, warnings=warnings + _remainder_warnings(config))


def _refuse_old_fault_section(data: dict[str, Any], where: str) -> None:
    """dtrain's fault injection was the `debug:` section; `debug` is now Determined's boolean, so a mapping
    there is the old spelling and gets one line that says how to rename it."""
    old = data.get("debug")
    if isinstance(old, dict):
        keys = ", ".join(sorted(old)) or "its keys"
        raise ConfigError(f"the `debug:` section{where} is now called `faults:` (`debug` is Determined's boolean "
                          f"flag); rename it, e.g. `faults: {{...}}` / `--set faults.<key>=...` ({keys})")


def dump_config(config: ExperimentConfig) -> str:
    """The fully resolved config as YAML, loadable again by `load_config`."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def _remainder_warnings(config: ExperimentConfig) -> list[str]:
    """The warning that the global batch does not split evenly over the slots, if it does not."""
    if config.is_command:
        return []
    gbs, world = config.global_batch_size, config.resources.world_size
    if gbs % world:
        used = gbs // world * world
        return [f"global_batch_size {gbs} is not divisible by {world} slots: each slot trains on {gbs // world} "
                f"records per batch and {gbs - used} are dropped (effective global batch {used})"]
    return []

