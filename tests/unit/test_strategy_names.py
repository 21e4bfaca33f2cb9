"""Strategy names are spelled only where strategies are defined: `dtrain/sync/` (each strategy's module and the
registry) and the config's names module. Everywhere else code asks the registry or the strategy's config
section (dtrain/config/strategies.py), so a new strategy touches no other file. The same check by hand:

    grep -rnE "[\\"'](allreduce|parameter_server|local_sgd|hierarchical|zero1|fsdp|hsdp|pipeline)[\\"']" dtrain \\
        --include='*.py' | grep -vE '^dtrain/(sync/|config/names\\.py|plan/|commands/plan\\.py|horovod/|calibrate/)'

Left out on purpose, since the same words name other things there: `plan/` and `commands/plan.py` (the pure
performance model's own algorithms and memory layouts, below every other layer), `horovod/` and `calibrate/`
(`allreduce` is the collective's name: Horovod's op, the calibration's measurement).
"""

from __future__ import annotations

import re
import typing
from pathlib import Path

from dtrain.config import StrategyName

ROOT = Path(__file__).resolve().parents[2]
WHERE_DEFINED = ("dtrain/sync/", "dtrain/config/names.py")
OTHER_VOCABULARIES = ("dtrain/plan/", "dtrain/commands/plan.py", "dtrain/horovod/", "dtrain/calibrate/")


def _quoted_names(names: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("[\"'](" + "|".join(re.escape(name) for name in names) + ")[\"']")


def _spelled(pattern: re.Pattern[str]) -> list[str]:
    found = []
    for path in sorted((ROOT / "dtrain").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith(WHERE_DEFINED + OTHER_VOCABULARIES):
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if pattern.search(line):
                found.append(f"{relative}:{number}: {line.strip()}")
    return found


def test_no_strategy_name_is_spelled_outside_sync_and_the_names_module() -> None:
    assert _spelled(_quoted_names(typing.get_args(StrategyName))) == []


def test_the_check_finds_a_name_tested_by_literal() -> None:
    """The scan can fail: it finds a word that code outside sync/ does spell in quotes (distributed.op's
    default, `average`, in config/distributed.py)."""
    assert _spelled(_quoted_names(("average",)))
