"""What every config section shares (strict keys), and the one value type used in several sections: Length.

A rule that a section's validator raises names the full key it is about at the start of its message
(`distributed.compression.ratio (0.1) applies to ...`); only a section used in several places (Length) or
inside a list (a fault-injection kill) leaves the key out, and the message translator puts its location in front.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, TypeVar, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.fields import FieldInfo

from dtrain.errors import ConfigError

LENGTH_UNITS = ("batches", "records", "epochs")

# The description of a key that a Determined file may hold and dtrain accepts without using it.
DETERMINED_ONLY = "accepted from Determined's file; dtrain does not use it"


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, numbers given for strings become strings."""

    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True, validate_assignment=True)


def picked_by(value: Any, key: str, default: str) -> Any:
    """The raw input of a section picked by `key` (a discriminated union): a bare name stands for `{key: name}`
    (`compression: fp16`), and a section that leaves `key` out gets `default` (`compression: {}` is `none`)."""
    if isinstance(value, str):
        return {key: value}
    if isinstance(value, dict) and key not in value:
        return {**value, key: default}
    return value


SectionT = TypeVar("SectionT", bound=BaseModel)


def variants(union: Any, key: str, base: type[SectionT]) -> dict[str, type[SectionT]]:
    """The sections of a union picked by `key` (a pydantic discriminated union, `Annotated` or bare), each a
    subclass of `base`, by the name that picks each, in the union's order."""
    members = get_args(union)
    if get_origin(union) is Annotated:
        members = get_args(members[0])
    found: dict[str, type[SectionT]] = {}
    for member in members:
        if not (isinstance(member, type) and issubclass(member, base)):
            raise TypeError(f"{member!r} in a union picked by {key!r} is not a {base.__name__}")
        found[member.model_fields[key].default] = member
    return found


def field_variants(info: FieldInfo) -> dict[str, type[BaseModel]]:
    """The sections a field picks from by a key, by name; {} for a field that is not such a union."""
    if not isinstance(info.discriminator, str):
        return {}
    return variants(info.annotation, info.discriminator, BaseModel)


class Length(Section):
    """A training length or period: exactly one of `{batches: N}`, `{records: N}` or `{epochs: N}`
    (Determined's length). Records and epochs are rounded up to whole global batches."""

    batches: int | None = Field(default=None, ge=0, description="global batches (optimizer steps)")
    records: int | None = Field(default=None, ge=0, description="training records over all workers")
    epochs: int | None = Field(default=None, ge=0, description="passes over the training data (see "
                                                              "`records_per_epoch`)")

    @model_validator(mode="before")
    @classmethod
    def _bare_number(cls, data: object) -> object:
        """Determined's Core API examples give a length as a bare number (their units are the script's own)."""
        if isinstance(data, int) and not isinstance(data, bool):
            return {"batches": data}
        return data

    @model_validator(mode="after")
    def _exactly_one_unit(self) -> Length:
        given = [unit for unit in LENGTH_UNITS if getattr(self, unit) is not None]
        if len(given) != 1:
            raise ValueError(f"a length needs exactly one of batches, records or epochs (got {given or 'none'}); "
                             "write e.g. `{epochs: 5}` or `{batches: 1000}`")
        return self

    @property
    def unit(self) -> str:
        return next(u for u in LENGTH_UNITS if getattr(self, u) is not None)

    @property
    def value(self) -> int:
        return int(getattr(self, self.unit))

    def to_batches(self, global_batch_size: int, records_per_epoch: int) -> int:
        """Convert to batches (one batch = one global batch of records); epochs need `records_per_epoch`."""
        if self.unit == "batches":
            return self.value
        if self.unit == "records":
            return math.ceil(self.value / global_batch_size)
        if records_per_epoch <= 0:
            raise ConfigError(f"a length of {{epochs: {self.value}}} needs the epoch size; set "
                              "`records_per_epoch` or let the Trial's training data define it")
        return math.ceil(self.value * records_per_epoch / global_batch_size)
