"""Checkpoints: written atomically by rank 0, verified by checksums, named `latest` only when complete.

Layout of `checkpoints/step-<N>/`:
- `model.pt`  the model's plain state_dict (`torch.load(path, weights_only=True)` works on it);
- `state.pt`  optimizer, LR scheduler, strategy and trainer state, and every rank's RNG states;
- `meta.json` step, sizes and SHA-256 of the two files (written last, so its presence marks completion).
A sharded run (FSDP) writes its model and optimizer state with torch.distributed.checkpoint, every rank its own
shards, under `checkpoints/sharded/step-<N>/` before rank 0 writes `step-<N>/` (whose `state.pt` then names that
directory under `sharded` and whose `model.pt` holds no weights: `dtrain export` makes a plain one).
`checkpoints/latest` holds the name of the newest complete checkpoint. A write goes to a hidden
`.partial-*` directory that is renamed into place, so a kill in the middle never leaves a half
checkpoint under a real name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dtrain.errors import CheckpointError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MODEL_FILE, STATE_FILE, META_FILE, LATEST_FILE = "model.pt", "state.pt", "meta.json", "latest"
SHARDED_DIR = "sharded"  # checkpoints/sharded/step-<N>/: the shards every rank wrote (DCP)


@dataclass(frozen=True)
class CheckpointRef:
    """A complete checkpoint on disk."""

    path: Path
    step: int

    @property
    def model_path(self) -> Path:
        return self.path / MODEL_FILE


def checkpoint_name(step: int) -> str:
    return f"step-{step}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_file(obj: Any, path: Path) -> None:
    with path.open("wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())


def write_checkpoint(root: Path, step: int, model_state: dict[str, Any], state: dict[str, Any],
                     extra_meta: dict[str, Any] | None = None,
                     after_model_file: Callable[[], None] | None = None) -> CheckpointRef:
    """Write a complete checkpoint for `step` and point `latest` at it; call on one rank only.
    `after_model_file` runs between the two data files (fault injection kills the writer there)."""
    root.mkdir(parents=True, exist_ok=True)
    partial = root / f".partial-{checkpoint_name(step)}-{os.getpid()}"
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir()
    _save_file(model_state, partial / MODEL_FILE)
    if after_model_file is not None:
        after_model_file()
    _save_file(state, partial / STATE_FILE)
    files = {name: {"sha256": _sha256(partial / name), "bytes": (partial / name).stat().st_size}
             for name in (MODEL_FILE, STATE_FILE)}
    meta = {"format": FORMAT_VERSION, "step": step, "created": time.time(), "files": files, **(extra_meta or {})}
    with (partial / META_FILE).open("w") as handle:
        json.dump(meta, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    _fsync_dir(partial)
    final = root / checkpoint_name(step)
    if final.exists():  # the same step written again after a restart: replace it
        stale = root / f".stale-{checkpoint_name(step)}-{os.getpid()}"
        final.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    partial.rename(final)
    _fsync_dir(root)
    _point_latest(root, final.name)
    return CheckpointRef(path=final, step=step)


def _point_latest(root: Path, name: str) -> None:
    tmp = root / f".{LATEST_FILE}.{os.getpid()}"
    tmp.write_text(name + "\n")
    with tmp.open("rb") as handle:
        os.fsync(handle.fileno())
    tmp.replace(root / LATEST_FILE)
    _fsync_dir(root)


def verify_checkpoint(path: Path) -> CheckpointRef:
    """Check that a checkpoint directory is complete and its files match their checksums."""
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise CheckpointError(f"checkpoint {path} has no {META_FILE}, so it was never completed")
    try:
        meta = json.loads(meta_path.read_bytes())
        files, step = meta["files"], int(meta["step"])
        expected = {name: (int(files[name]["bytes"]), str(files[name]["sha256"])) for name in (MODEL_FILE, STATE_FILE)}
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise CheckpointError(f"checkpoint {path}: {META_FILE} is unreadable or lacks the sizes and checksums of "
                              f"{MODEL_FILE} and {STATE_FILE}") from None
    for name, (size, digest) in expected.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} lacks {name}")
        if file.stat().st_size != size or _sha256(file) != digest:
            raise CheckpointError(f"checkpoint {path}: {name} does not match its checksum (corrupt or partly written)")
    return CheckpointRef(path=path, step=step)


def list_checkpoints(root: Path) -> list[Path]:
    """Checkpoint directories by step, oldest first (complete or not)."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        if child.is_dir() and child.name.startswith("step-") and child.name[5:].isdigit():
            found.append((int(child.name[5:]), child))
    return [path for _, path in sorted(found)]


def find_resume_checkpoint(root: Path) -> CheckpointRef | None:
    """The checkpoint named by `latest` if it verifies, else the newest one that does (with a warning)."""
    latest_file = root / LATEST_FILE
    if not latest_file.is_file():
        return None
    name = latest_file.read_bytes().decode("utf-8", "replace").strip()
    problems = []
    if re.fullmatch(r"step-\d+", name) is None:  # never a path: `latest` must not lead outside checkpoints/
        problems.append(f"{latest_file} holds {name[:40]!r}, not a checkpoint name like step-100")
    named = root / name if not problems else None
    candidates = ([named] if named is not None else []) + [p for p in reversed(list_checkpoints(root)) if p != named]
    for candidate in candidates:
        try:
            ref = verify_checkpoint(candidate)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        if problems:
            log.warning("%s; resuming from the previous complete checkpoint %s instead", "; ".join(problems), ref.path)
        return ref
    raise CheckpointError(f"no usable checkpoint in {root}: {'; '.join(problems)}; move {root} away to start "
                          "the run from scratch")


def load_checkpoint(ref: CheckpointRef) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model state_dict and the resume state, loaded with weights_only=True."""
    try:
        model_state = torch.load(ref.path / MODEL_FILE, map_location="cpu", weights_only=True)
        state = torch.load(ref.path / STATE_FILE, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise CheckpointError(f"checkpoint {ref.path} cannot be loaded (UnpicklingError): it holds objects other than "
                              "tensors and plain containers, which torch.load(weights_only=True) refuses because "
                              "loading them could run code; it was not loaded - use checkpoints you wrote") from None
    except Exception as exc:  # the unpickler raises many kinds; all mean "not a checkpoint we can read"
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()
        raise CheckpointError(f"checkpoint {ref.path} cannot be loaded ({type(exc).__name__}: "
                              f"{text.splitlines()[0][:200] if text else ''})") from None
    return model_state, state


def remove_stale_partials(root: Path) -> None:
    """Delete leftovers of writes that were killed."""
    if root.is_dir():
        for child in root.iterdir():
            if child.name.startswith((".partial-", ".stale-")):
                shutil.rmtree(child, ignore_errors=True)


def prune_checkpoints(root: Path, keep_latest: int, keep_steps: set[int]) -> None:
    """Delete complete checkpoints except the newest `keep_latest`, the ones in `keep_steps` and `latest`."""
    paths = list_checkpoints(root)
    latest_file = root / LATEST_FILE
    latest = latest_file.read_text().strip() if latest_file.is_file() else None
    newest = {p.name for p in paths[-keep_latest:]} if keep_latest > 0 else set()
    for path in paths:
        if path.name in newest or path.name == latest or int(path.name[5:]) in keep_steps:
            continue
        shutil.rmtree(path, ignore_errors=True)
    kept = {path.name for path in list_checkpoints(root)}
    sharded = root / SHARDED_DIR
    if sharded.is_dir():  # shards whose checkpoint is gone (pruned, or never completed)
        for path in sharded.iterdir():
            if path.name not in kept:
                shutil.rmtree(path, ignore_errors=True)
