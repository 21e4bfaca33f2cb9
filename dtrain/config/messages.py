"""Pydantic's validation errors -> one line that names the key once and gives the value, the rule and the fix.

A section's own rules name their key at the start of their message (see `dtrain.config.base`); the translator
adds the location pydantic reports only to messages that do not, and to pydantic's own errors (types,
bounds, choices, unknown and missing keys), which it words itself.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from dtrain.config.base import LENGTH_UNITS, field_variants
from dtrain.config.experiment import ExperimentConfig

REFERENCE = "docs/config-reference.md"

# A dotted key at the start of a message: `distributed.parameter_server.backup_workers (1) applies ...`.
_LEADING_KEY = re.compile(r"`?([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)*)")

# Pydantic's bound errors: the sign and how to fix a value on the wrong side of the bound.
_BOUNDS = {
    "greater_than_equal": ("ge", ">=", "set it to at least"),
    "greater_than": ("gt", ">", "set it above"),
    "less_than_equal": ("le", "<=", "set it to at most"),
    "less_than": ("lt", "<", "set it below"),
}

_EXAMPLES = {
    "entrypoint": "`entrypoint: model_def:MyTrial`",
    "hyperparameters": "`hyperparameters: {global_batch_size: 128}`",
    "searcher": "`searcher: {name: single, metric: validation_loss, max_length: {epochs: 1}}`",
    "max_length": "`max_length: {epochs: 1}`",
    "slots_per_trial": "`slots_per_trial: 2`",
    "records_per_epoch": "`records_per_epoch: 60000`",
    "max_restarts": "`max_restarts: 5`",
}


def explain(exc: ValidationError, override_keys: Sequence[str]) -> str:
    """The first problem as one line, with how many more there are; `override_keys` came from `--set`."""
    errors = exc.errors()
    first = _explain_one(errors[0], override_keys)
    if len(errors) > 1:
        first += f" ({len(errors) - 1} more problem{'s' if len(errors) > 2 else ''} after this one)"
    return first


def _explain_one(error: Any, override_keys: Sequence[str]) -> str:
    raw = [str(part) for part in error["loc"] if not str(part).startswith("function-")]
    loc = _walk(raw)[0]
    dotted = ".".join(loc)
    origin = _origin(dotted, override_keys)
    kind = error["type"]
    value = error.get("input")
    ctx = error.get("ctx") or {}
    if kind == "extra_forbidden":
        return _unknown_key(raw, value) + origin
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        return _bad_tag(raw, ctx, origin)
    if kind == "missing":
        return f"`{dotted}` is required{origin}; add it, e.g. {_example(loc)}"
    if kind == "value_error":
        message = str(ctx.get("error", error["msg"]))
        named = _key_named_by(message, dotted)
        if named is not None:
            return message + _origin(named, override_keys)
        return f"`{dotted}`{origin}: {message}" if dotted else message
    shown = f"{value!r}"
    if kind in _BOUNDS:
        ctx_key, sign, fix = _BOUNDS[kind]
        bound = ctx.get(ctx_key)
        bound = f"{bound:g}" if isinstance(bound, float) else bound
        return f"`{dotted}` = {shown}{origin} must be {sign} {bound}; {fix} {bound}"
    if kind == "literal_error":
        choices = [c.strip(" '") for c in str(ctx.get("expected", "")).replace(" or ", ",").split(",")]
        choices = [c for c in choices if c]
        return _not_a_choice(dotted, shown, origin, choices)
    if kind.startswith(("int_", "float_", "bool_", "string_", "dict_", "list_", "model_")):
        family = kind.split("_")[0]
        wanted = {"int": "an integer", "float": "a number", "bool": "true or false", "string": "a string",
                  "dict": "a mapping of keys", "list": "a list", "model": "a section of keys"}[family]
        if family == "model" and loc and loc[-1] not in _EXAMPLES:
            return (f"`{dotted}` = {shown}{origin} must be a section of keys; write its keys indented under "
                    f"`{loc[-1]}:` (valid: {', '.join(_fields_at(raw))})")
        example = f"`{loc[-1]}: true`" if family == "bool" and loc else _example(loc)
        return f"`{dotted}` = {shown}{origin} must be {wanted}; write e.g. {example}"
    return f"`{dotted}` = {shown}{origin} is invalid: {error['msg']}; check its documented type in {REFERENCE}"


def _key_named_by(message: str, dotted: str) -> str | None:
    """The key a rule's message starts with, if it names the key pydantic located (`dotted`) or one under it;
    for a rule of the whole file (no location), any key of the file."""
    match = _LEADING_KEY.match(message)
    if match is None:
        return None
    key = match.group(1)
    if dotted:
        return key if key == dotted or key.startswith(dotted + ".") else None
    return key if key.split(".")[0] in ExperimentConfig.model_fields else None


def _origin(key: str, override_keys: Sequence[str]) -> str:
    """` (from --set)` when `key` was set by an override, or lies inside or around a key that was."""
    if key and any(key == k or key.startswith(k + ".") or k.startswith(key + ".") for k in override_keys):
        return " (from --set)"
    return ""


def _unknown_key(raw: list[str], value: Any) -> str:
    parent, _, picked = _walk(raw[:-1])
    key = raw[-1]
    if picked is not None and picked[1] is not None:  # a key of another variant: say whose it is
        tag_key, tag, variants = picked
        owners = [name for name, variant in variants.items() if key in variant.model_fields]
        if owners:
            where = ".".join(parent)
            return (f"{where}.{key} ({value}) applies to {' or '.join(owners)}, not to `{tag}`; remove it or change "
                    f"{where}.{tag_key}")
    valid = sorted(_fields_at(raw[:-1]))
    near = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    where = f"section `{'.'.join(parent)}`" if parent else "the top level"
    hint = f"did you mean `{'.'.join(parent + [near[0]])}`?" if near else f"valid keys here: {', '.join(valid)}"
    return f"unknown config key `{'.'.join(parent + [key])}` (value {value!r}) in {where}; {hint}"


def _bad_tag(raw: list[str], ctx: Any, origin: str) -> str:
    """A section picked by a key (`distributed.compression.name`) given no name, or one no variant has."""
    loc, _, picked = _walk(raw)
    tag_key = str(ctx.get("discriminator", "name")).strip("'")
    choices = list(picked[2]) if picked is not None else []
    dotted = ".".join(loc + [tag_key])
    tag = ctx.get("tag")
    if tag is None:
        return f"`{dotted}` is required{origin}; add it, e.g. `{tag_key}: {choices[0] if choices else '<name>'}`"
    return _not_a_choice(dotted, repr(tag), origin, choices)


def _not_a_choice(dotted: str, shown: str, origin: str, choices: list[str]) -> str:
    """A value that is none of the choices: the choices once, and the nearest one when there is one."""
    near = difflib.get_close_matches(shown.strip("'\""), choices, n=1)
    hint = f"did you mean `{near[0]}`?" if near else "set it to one of them"
    return f"`{dotted}` = {shown}{origin} must be one of {', '.join(choices)}; {hint}"


def _walk(raw: list[str]) -> tuple[list[str], Any, tuple[str, str | None, dict[str, Any]] | None]:
    """Follow pydantic's location `raw` down the sections: (the location as the file spells it, the section
    class it ends in or None, and where it ends in a section picked by a key: that key, the name picked (None
    when the location stops at the key's section itself) and every variant by its name).

    Pydantic puts the picked variant's name after such a section: `distributed.compression.topk.ratio` is the
    file's `distributed.compression.ratio`."""
    model: Any = ExperimentConfig
    clean: list[str] = []
    picked: tuple[str, str | None, dict[str, Any]] | None = None
    parts = iter(raw)
    for part in parts:
        clean.append(part)
        if part.isdigit():
            continue
        info = model.model_fields.get(part) if hasattr(model, "model_fields") else None
        if info is None:
            model, picked = None, None
            continue
        variants = field_variants(info)
        if variants:
            tag = next(parts, None)
            model, picked = variants.get(tag) if tag is not None else None, (info.discriminator, tag, variants)
        else:
            model, picked = _model_of(info.annotation), None
    return clean, model, picked


def _fields_at(raw: list[str]) -> list[str]:
    """The keys of the section at pydantic's location `raw` (list indices, as in `faults.kills.0`, step into
    the list's items; a section picked by a key gives the picked variant's keys)."""
    _, model, picked = _walk(raw)
    if model is None and picked is not None:  # the section picked by a key, before it is picked: any variant's
        return list(dict.fromkeys(key for variant in picked[2].values() for key in variant.model_fields))
    return list(getattr(model, "model_fields", {}).keys())


def _model_of(annotation: Any) -> Any:
    """The section class inside a field's type (`Section`, `Section | None`, `list[Section]`), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _example(loc: list[str]) -> str:
    key = loc[-1] if loc else ""
    if key in _EXAMPLES:
        return _EXAMPLES[key]
    if key in LENGTH_UNITS:
        return f"`{key}: 10`"
    return f"`{key}: <value>` as {REFERENCE} shows"
