"""Determined's custom metric reducers (`context.wrap_reducer`): metrics that are not a mean of batch means (a
median, an AUC, a max) computed over every slot's data.

A reducer is a `MetricReducer` (the trial updates it itself, e.g. in evaluate_batch; `per_slot_reduce()` on each
slot, `cross_slot_reduce(per_slot_values)` over all slots' values) or a plain function of the flat list of values
given to `.update()` (the slots' values interleaved, which restores the order of the batches when each slot updates
once per batch, as Determined does). Reducers are reset at the start of each validation (`for_validation`) and of
each training report period (`for_training`), and reduced at its end; every rank takes part (one allgather of all
reducers' per-slot values), and the result joins the metrics dtrain records.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dtrain.determined.pytorch import MetricReducer
from dtrain.errors import TrialError
from dtrain.train.batches import metric_value

_MISSING = object()


class SimpleReducer(MetricReducer):
    """A reducer function as a MetricReducer: `update(value)` collects, the function reduces all slots' values."""

    def __init__(self, fn: Callable[[list[Any]], Any]) -> None:
        self.fn = fn
        self.values: list[Any] = []

    def reset(self) -> None:
        self.values = []

    def update(self, value: Any) -> None:
        self.values.append(value)

    def per_slot_reduce(self) -> Any:
        return self.values

    def cross_slot_reduce(self, per_slot_metrics: list[Any]) -> Any:
        interleaved = itertools.zip_longest(*per_slot_metrics, fillvalue=_MISSING)
        return self.fn([value for row in interleaved for value in row if value is not _MISSING])


@dataclass
class WrappedReducer:
    reducer: MetricReducer
    name: str | None
    for_training: bool
    for_validation: bool

    @property
    def label(self) -> str:
        what = self.reducer.fn.__name__ if isinstance(self.reducer, SimpleReducer) else type(self.reducer).__name__
        return f"reducer {what} (name={self.name!r})"


class Reducers:
    """The reducers a trial wrapped, and their reduction over the slots."""

    def __init__(self, allgather: Callable[[Any], list[Any]]) -> None:
        self.allgather = allgather
        self.wrapped: list[WrappedReducer] = []

    def wrap(self, reducer: Any, name: str | None, for_training: bool, for_validation: bool) -> MetricReducer:
        if any(reducer is w.reducer or (isinstance(w.reducer, SimpleReducer) and w.reducer.fn is reducer)
               for w in self.wrapped):
            raise TrialError(f"context.wrap_reducer() got the same {type(reducer).__name__} twice; wrap each "
                             "reducer once")
        if not isinstance(reducer, MetricReducer):
            if not callable(reducer):
                raise TrialError(f"context.wrap_reducer() got {type(reducer).__name__}; give it a function of the "
                                 "list of values or a determined.pytorch.MetricReducer")
            reducer = SimpleReducer(reducer)
        if name is not None and not isinstance(name, str):
            raise TrialError(f"context.wrap_reducer(name={name!r}): give a metric name or None")
        if any(name is not None and w.name == name for w in self.wrapped):
            raise TrialError(f"context.wrap_reducer(name={name!r}): two reducers have that name; give each its own")
        reducer.reset()
        self.wrapped.append(WrappedReducer(reducer, name, for_training, for_validation))
        return reducer

    def _of(self, for_training: bool) -> list[WrappedReducer]:
        return [w for w in self.wrapped if (w.for_training if for_training else w.for_validation)]

    def reset(self, *, for_training: bool) -> None:
        for wrapped in self._of(for_training):
            wrapped.reducer.reset()

    def reduce(self, *, for_training: bool) -> dict[str, float]:
        """The reducers' metrics over all slots (every rank calls it together; every rank gets them)."""
        reducers = self._of(for_training)
        if not reducers:
            return {}
        gathered = self.allgather([w.reducer.per_slot_reduce() for w in reducers])
        metrics: dict[str, float] = {}
        for index, wrapped in enumerate(reducers):
            reduced = wrapped.reducer.cross_slot_reduce([slot[index] for slot in gathered])
            if wrapped.name is None:
                if not isinstance(reduced, dict):
                    raise TrialError(f"{wrapped.label} returned a {type(reduced).__name__}; with name=None it must "
                                     "return a dict {metric name: value} (or give wrap_reducer a name)")
                for key, value in reduced.items():
                    metrics[str(key)] = metric_value(str(key), value, f"{wrapped.label}")
            else:
                if isinstance(reduced, dict):
                    raise TrialError(f"{wrapped.label} returned a dict; with a name it must return one value "
                                     "(or leave name=None to return a dict of metrics)")
                metrics[wrapped.name] = metric_value(wrapped.name, reduced, f"{wrapped.label}")
        return metrics
