"""Fault tests run real gloo processes through the one spawn fixture of tests/distributed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.distributed.conftest import run_spawned


@pytest.fixture
def spawn() -> Callable[..., list[Any]]:
    return run_spawned
