"""What the experiment file's `entrypoint` names: a Trial class (`module:Class`, `file.py:Class`) that dtrain's
loop trains, or a command (`python3 train.py --epochs 1`, as a string or a list) that dtrain starts on each slot,
as Determined does. Determined's launch layers in front of a command are read here too:
`python3 -m determined.launch.torch_distributed [--trial module:Class | [--] CMD...]` is what dtrain does anyway
(one process per slot on torch.distributed), so it is taken off; the launchers dtrain has no counterpart for
(DeepSpeed, Horovod's through Determined) are one line."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Literal

TORCH_LAUNCHER = "determined.launch.torch_distributed"
PYTHONS = ("python", "python3")
UNSUPPORTED_LAUNCHERS = {
    "determined.launch.deepspeed": "DeepSpeed launch is not available in dtrain; train the model with "
                                   "determined.launch.torch_distributed (dtrain's distributed: strategies) instead",
    "determined.launch.horovod": "Determined's Horovod launch layer is not available; run the script with "
                                 "`dtrain horovodrun` or use determined.launch.torch_distributed",
    "determined.launch.tensorflow": "TensorFlow is not supported by dtrain (PyTorch only)",
}


@dataclass(frozen=True)
class Entrypoint:
    """`kind` class: `target` is `module:Class`; `kind` command: `argv` is the command, launchers taken off."""

    kind: Literal["class", "command"]
    target: str = ""
    argv: tuple[str, ...] = ()

    @property
    def is_command(self) -> bool:
        return self.kind == "command"


def parse_entrypoint(value: str | list[str]) -> Entrypoint:
    """Read `entrypoint`; ValueError (one line, with the fix) for what is not a class, not a command, or asks for
    a launcher dtrain does not have."""
    if isinstance(value, list):
        argv = [str(part) for part in value]
    else:
        text = value.strip()
        if not text:
            raise ValueError("entrypoint is empty; name a Trial class (`model_def:MyTrial`) or a command "
                             "(`python3 train.py`)")
        if not any(ch.isspace() for ch in text) and _is_class_target(text):
            return Entrypoint("class", target=text)
        try:
            argv = shlex.split(text)
        except ValueError as exc:
            raise ValueError(f"entrypoint {value!r} is not a valid command line ({exc}); fix its quoting") from None
    if not argv:
        raise ValueError("entrypoint is empty; name a Trial class (`model_def:MyTrial`) or a command "
                         "(`python3 train.py`)")
    return _strip_launcher(argv, value)


def _is_class_target(text: str) -> bool:
    module, sep, qualname = text.partition(":")
    return bool(sep and module and qualname) and "/" not in qualname


def _strip_launcher(argv: list[str], original: str | list[str]) -> Entrypoint:
    """`python3 -m determined.launch.X ...` -> what it launches; anything else is the command itself."""
    if len(argv) >= 3 and argv[0] in PYTHONS and argv[1] == "-m" and argv[2].startswith("determined.launch"):
        launcher, rest = argv[2], argv[3:]
        if launcher in UNSUPPORTED_LAUNCHERS:
            raise ValueError(f"entrypoint {original!r} uses {launcher}: {UNSUPPORTED_LAUNCHERS[launcher]}")
        if launcher != TORCH_LAUNCHER:
            raise ValueError(f"entrypoint {original!r} uses {launcher}, which dtrain does not have; use "
                             f"`python3 -m {TORCH_LAUNCHER} python3 train.py` or just `python3 train.py`")
        while rest and rest[0].startswith("-") and rest[0] != "--":
            option = rest.pop(0)
            if option == "--trial":
                if not rest or not _is_class_target(rest[0]):
                    raise ValueError(f"entrypoint {original!r}: --trial needs `module:Class`, e.g. "
                                     "`--trial model_def:MyTrial`")
                return Entrypoint("class", target=rest[0])
            if "=" not in option and rest and not rest[0].startswith("-"):
                rest.pop(0)  # a launcher option's value (torchrun's, e.g. --max_restarts 3): dtrain sets these
        if rest and rest[0] == "--":
            rest = rest[1:]
        if not rest:
            raise ValueError(f"entrypoint {original!r} launches nothing; add the script, e.g. "
                             f"`python3 -m {TORCH_LAUNCHER} python3 train.py`")
        argv = rest
    return Entrypoint("command", argv=tuple(argv))
