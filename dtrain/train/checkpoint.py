"""Checkpoints: written by rank 0 through the checkpoint storage layer (`dtrain.runs.storage`: a local folder or
object storage), verified by checksums, counted only once complete, named `latest` only then.

Layout of `<root>/step-<N>/` (root: the run dir's `checkpoints/`, or the run's folder in `checkpoint_storage`):
- `model.pt`  the model's plain state_dict (`torch.load(path, weights_only=True)` works on it);
- `state.pt`  optimizer, LR scheduler, strategy and trainer state, and every rank's RNG states;
- `meta.json` step, sizes and SHA-256 of the two files: the commit marker, written last; a folder without it is
  never read (and is deleted when a run resumes).
A sharded run (FSDP, pipeline) writes its model and optimizer state with torch.distributed.checkpoint, every rank
its own shards, under `<root>/sharded/step-<N>/` before rank 0 writes `step-<N>/` (whose `meta.json` and
`state.pt` then name that folder under `sharded`, and whose `model.pt` holds no weights: `dtrain export` makes a
plain one); DCP's `.metadata`, written last, marks the shards complete.
`<root>/latest` holds the name of the newest complete checkpoint. On a local folder a write goes to a hidden
`.partial-*` folder renamed into place; on object storage (no rename) the files are uploaded in place with
`meta.json` last and an older `meta.json` of the same step deleted first, so a kill in the middle of an upload
never leaves a checkpoint that a resume would take. Deleting one removes its `meta.json` first for the same reason.
With `checkpoint_storage.background_upload` rank 0 runs a plain checkpoint's write on a background thread
(dtrain.train.upload, `Checkpointer`): the same sequence, from a snapshot in host memory, with `latest` and
deletions after the commit.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dtrain.errors import CheckpointError
from dtrain.runs.storage import CheckpointStore, ShardFolder

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MODEL_FILE, STATE_FILE, META_FILE, LATEST_FILE = "model.pt", "state.pt", "meta.json", "latest"
SHARDED_DIR = "sharded"  # <root>/sharded/step-<N>/: the shards every rank wrote (DCP)
DCP_MARKER = ".metadata"  # DCP writes it last: the shards' commit marker
_STEP_NAME = re.compile(r"step-(\d+)")


@dataclass(frozen=True)
class CheckpointRef:
    """A complete checkpoint: its folder (a local Path, or a URL on object storage) and step."""

    path: Path | str
    step: int
    store: CheckpointStore | None = field(default=None, compare=False, repr=False)

    @property
    def name(self) -> str:
        return checkpoint_name(self.step) if self.store is not None else Path(str(self.path)).name

    def located(self) -> tuple[CheckpointStore, str]:
        """The store that holds it and its name there."""
        if self.store is not None:
            return self.store, self.name
        return CheckpointStore(url=str(Path(self.path).parent)), Path(self.path).name

    @property
    def model_path(self) -> Path:
        """The local path of `model.pt` (a local checkpoint only; see `model_location`)."""
        return Path(self.path) / MODEL_FILE

    @property
    def model_location(self) -> str:
        """`model.pt` as a path or URL."""
        store, name = self.located()
        return store.describe(f"{name}/{MODEL_FILE}")


def checkpoint_name(step: int) -> str:
    return f"step-{step}"


def as_store(root: Path | CheckpointStore) -> CheckpointStore:
    """A checkpoints root given as a local Path or as a store."""
    return root if isinstance(root, CheckpointStore) else CheckpointStore(url=str(root))


def _ref(store: CheckpointStore, name: str, step: int) -> CheckpointRef:
    if store.is_local:
        return CheckpointRef(path=store.local_path(name), step=step, store=store)
    return CheckpointRef(path=store.describe(name), step=step, store=store)


def _sha256_stream(handle: Any) -> str:
    digest = hashlib.sha256()
    for chunk in iter(lambda: handle.read(1 << 20), b""):
        digest.update(chunk)
    return digest.hexdigest()


def _sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return _sha256_stream(handle)


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


def _write_meta(folder: Path, step: int, extra_meta: dict[str, Any] | None) -> None:
    files = {name: {"sha256": _sha256(folder / name), "bytes": (folder / name).stat().st_size}
             for name in (MODEL_FILE, STATE_FILE)}
    meta = {"format": FORMAT_VERSION, "step": step, "created": time.time(), "files": files, **(extra_meta or {})}
    with (folder / META_FILE).open("w") as handle:
        json.dump(meta, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())


def write_checkpoint(root: Path | CheckpointStore, step: int, model_state: dict[str, Any], state: dict[str, Any],
                     extra_meta: dict[str, Any] | None = None,
                     after_model_file: Callable[[], None] | None = None) -> CheckpointRef:
    """Write a complete checkpoint for `step` and point `latest` at it; call on one rank only.
    `after_model_file` runs once `model.pt` is in place and before the rest (fault injection kills the writer
    there: in the middle of an upload on object storage)."""
    store = as_store(root)
    name = checkpoint_name(step)
    if store.is_local:
        _write_local(store.local_path(), name, step, model_state, state, extra_meta, after_model_file)
    else:
        with tempfile.TemporaryDirectory(prefix="dtrain-checkpoint-") as tmp:
            staged = Path(tmp)
            _save_file(model_state, staged / MODEL_FILE)
            _save_file(state, staged / STATE_FILE)
            _write_meta(staged, step, extra_meta)
            store.remove(f"{name}/{META_FILE}")  # an older write of this step stops counting before its files change
            store.upload(staged / MODEL_FILE, f"{name}/{MODEL_FILE}")
            if after_model_file is not None:
                after_model_file()
            store.upload(staged / STATE_FILE, f"{name}/{STATE_FILE}")
            store.upload(staged / META_FILE, f"{name}/{META_FILE}")  # the commit
    _point_latest(store, name)
    return _ref(store, name, step)


def _write_local(root: Path, name: str, step: int, model_state: dict[str, Any], state: dict[str, Any],
                 extra_meta: dict[str, Any] | None, after_model_file: Callable[[], None] | None) -> None:
    root.mkdir(parents=True, exist_ok=True)
    partial = root / f".partial-{name}-{os.getpid()}"
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir()
    _save_file(model_state, partial / MODEL_FILE)
    if after_model_file is not None:
        after_model_file()
    _save_file(state, partial / STATE_FILE)
    _write_meta(partial, step, extra_meta)
    _fsync_dir(partial)
    final = root / name
    if final.exists():  # the same step written again after a restart: replace it
        stale = root / f".stale-{name}-{os.getpid()}"
        final.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    partial.rename(final)
    _fsync_dir(root)


def _point_latest(store: CheckpointStore, name: str) -> None:
    if not store.is_local:
        store.write_bytes(LATEST_FILE, (name + "\n").encode())  # one PUT: the old name or the new one
        return
    root = store.local_path()
    tmp = root / f".{LATEST_FILE}.{os.getpid()}"
    tmp.write_text(name + "\n")
    with tmp.open("rb") as handle:
        os.fsync(handle.fileno())
    tmp.replace(root / LATEST_FILE)
    _fsync_dir(root)


def verify_checkpoint(path: Path | str, store: CheckpointStore | None = None) -> CheckpointRef:
    """Check that a checkpoint folder (a local path, or `path` as a name under `store`) is complete and its files
    match their checksums."""
    if store is None:
        store, name = CheckpointStore(url=str(Path(path).parent)), Path(path).name
    else:
        name = str(path)
    shown = store.describe(name)
    try:
        raw = store.read_bytes(f"{name}/{META_FILE}")
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise CheckpointError(f"checkpoint {shown} has no {META_FILE}, so it was never completed") from None
    try:
        meta = json.loads(raw)
        files, step = meta["files"], int(meta["step"])
        expected = {file: (int(files[file]["bytes"]), str(files[file]["sha256"])) for file in (MODEL_FILE, STATE_FILE)}
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise CheckpointError(f"checkpoint {shown}: {META_FILE} is unreadable or lacks the sizes and checksums of "
                              f"{MODEL_FILE} and {STATE_FILE}") from None
    for file, (size, digest) in expected.items():
        if not store.exists(f"{name}/{file}"):
            raise CheckpointError(f"checkpoint {shown} lacks {file}")
        with store.open(f"{name}/{file}") as handle:
            matches = store.size(f"{name}/{file}") == size and _sha256_stream(handle) == digest
        if not matches:
            raise CheckpointError(f"checkpoint {shown}: {file} does not match its checksum (corrupt or partly written)")
    sharded = meta.get("sharded")
    if isinstance(sharded, str) and not store.exists(f"{sharded}/{DCP_MARKER}"):
        raise CheckpointError(f"checkpoint {shown} names shards in {store.describe(sharded)}, which are incomplete "
                              f"(no {DCP_MARKER})")
    if isinstance(sharded, str):
        lost = missing_shard_files(store, sharded)
        if lost:
            raise CheckpointError(f"checkpoint {shown} names shards in {store.describe(sharded)}, which lack "
                                  f"{', '.join(lost[:4])} ({_writers(lost)}) that its {DCP_MARKER} names")
    return _ref(store, name, step)


_SHARD_FILE = re.compile(r"__(\d+)_\d+\.distcp")  # DCP's file of one rank: __<rank>_<n>.distcp


def missing_shard_files(store: CheckpointStore, folder: str) -> list[str]:
    """The files the shards' DCP metadata names that `folder` does not hold (a rank's file lost or never copied)."""
    try:
        metadata = store.dcp_reader(folder).read_metadata()
    except Exception as exc:  # DCP's unpickler and the filesystem raise many kinds: all mean "unreadable"
        raise CheckpointError(f"the shards in {store.describe(folder)} cannot be read: {DCP_MARKER} is unreadable "
                              f"({type(exc).__name__})") from None
    named = {str(info.relative_path) for info in (getattr(metadata, "storage_data", None) or {}).values()}
    present = set(store.listdir(folder))
    return sorted(name for name in named if name not in present)


def _writers(files: list[str]) -> str:
    ranks = sorted({int(m.group(1)) for m in map(_SHARD_FILE.fullmatch, files) if m is not None})
    return f"written by rank {', '.join(map(str, ranks))}" if ranks else "shard files"


def checkpoint_names(root: Path | CheckpointStore) -> list[str]:
    """Names of the checkpoint folders by step, oldest first (complete or not)."""
    store = as_store(root)
    found = []
    for entry in store.listdir():
        match = _STEP_NAME.fullmatch(entry)
        if match is not None and (not store.is_local or store.local_path(entry).is_dir()):
            found.append((int(match.group(1)), entry))
    return [entry for _, entry in sorted(found)]


def list_checkpoints(root: Path | CheckpointStore) -> list[Path | str]:
    """Checkpoint folders by step, oldest first (complete or not): Paths on a local folder, URLs elsewhere."""
    store = as_store(root)
    return [store.local_path(name) if store.is_local else store.describe(name) for name in checkpoint_names(store)]


def read_latest_name(root: Path | CheckpointStore) -> str | None:
    """What `latest` holds (stripped), or None when there is none."""
    store = as_store(root)
    try:
        return store.read_bytes(LATEST_FILE).decode("utf-8", "replace").strip()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None


def read_latest_meta(root: Path | CheckpointStore) -> dict[str, Any] | None:
    """The `meta.json` of the checkpoint `latest` names, without verifying its files; None when there is none or it
    cannot be read (a resume verifies it anyway)."""
    store = as_store(root)
    name = read_latest_name(store)
    if name is None or _STEP_NAME.fullmatch(name) is None:
        return None
    try:
        meta = json.loads(store.read_bytes(f"{name}/{META_FILE}"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return meta if isinstance(meta, dict) else None


def find_resume_checkpoint(root: Path | CheckpointStore) -> CheckpointRef | None:
    """The checkpoint named by `latest` if it verifies, else the newest one that does (with a warning)."""
    store = as_store(root)
    name = read_latest_name(store)
    if name is None:
        return None
    problems = []
    if _STEP_NAME.fullmatch(name) is None:  # never a path: `latest` must not lead outside the checkpoints root
        problems.append(f"{store.describe(LATEST_FILE)} holds {name[:40]!r}, not a checkpoint name like step-100")
    named = name if not problems else None
    candidates = ([named] if named is not None else []) + [n for n in reversed(checkpoint_names(store)) if n != named]
    for candidate in candidates:
        try:
            ref = verify_checkpoint(candidate, store)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        if problems:
            log.warning("%s; resuming from the previous complete checkpoint %s instead", "; ".join(problems),
                        store.describe(candidate))
        return ref
    raise CheckpointError(f"no usable checkpoint in {store.describe()}: {'; '.join(problems)}; move "
                          f"{store.describe()} away to start the run from scratch")


def _torch_load(store: CheckpointStore, name: str) -> Any:
    if store.is_local:
        return torch.load(store.local_path(name), map_location="cpu", weights_only=True)
    return torch.load(io.BytesIO(store.read_bytes(name)), map_location="cpu", weights_only=True)


def load_checkpoint(ref: CheckpointRef) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model state_dict and the resume state, loaded with weights_only=True."""
    store, name = ref.located()
    shown = store.describe(name)
    try:
        model_state = _torch_load(store, f"{name}/{MODEL_FILE}")
        state = _torch_load(store, f"{name}/{STATE_FILE}")
    except pickle.UnpicklingError:
        raise CheckpointError(f"checkpoint {shown} cannot be loaded (UnpicklingError): it holds objects other than "
                              "tensors and plain containers, which torch.load(weights_only=True) refuses because "
                              "loading them could run code; it was not loaded - use checkpoints you wrote") from None
    except Exception as exc:  # the unpickler raises many kinds; all mean "not a checkpoint we can read"
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()
        raise CheckpointError(f"checkpoint {shown} cannot be loaded ({type(exc).__name__}: "
                              f"{text.splitlines()[0][:200] if text else ''})") from None
    return model_state, state


def load_state_file(ref: CheckpointRef) -> dict[str, Any]:
    """`state.pt` alone (weights_only)."""
    store, name = ref.located()
    return dict(_torch_load(store, f"{name}/{STATE_FILE}"))


def shard_folder(root: Path | CheckpointStore, step: int) -> ShardFolder:
    """Where the shards of `step` go (`sharded/step-<N>`)."""
    return ShardFolder(as_store(root), f"{SHARDED_DIR}/{checkpoint_name(step)}")


def remove_stale_partials(root: Path | CheckpointStore) -> None:
    """Delete leftovers of writes that were killed (on object storage: step folders without `meta.json`)."""
    store = as_store(root)
    if store.is_local:
        local = store.local_path()
        if local.is_dir():
            for child in local.iterdir():
                if child.name.startswith((".partial-", ".stale-")):
                    shutil.rmtree(child, ignore_errors=True)
        return
    for name in checkpoint_names(store):
        if not store.exists(f"{name}/{META_FILE}"):
            store.remove(name, recursive=True)


def _delete(store: CheckpointStore, name: str) -> None:
    """A checkpoint stops counting (its marker goes first), then its files go."""
    store.remove(f"{name}/{META_FILE}")
    store.remove(name, recursive=True)


def prune_checkpoints(root: Path | CheckpointStore, keep_latest: int, keep_steps: set[int]) -> None:
    """Delete checkpoints except the newest `keep_latest`, the ones in `keep_steps` and `latest`."""
    store = as_store(root)
    names = checkpoint_names(store)
    latest = read_latest_name(store)
    newest = set(names[-keep_latest:]) if keep_latest > 0 else set()
    for name in names:
        if name in newest or name == latest or int(name[5:]) in keep_steps:
            continue
        _delete(store, name)
    kept = set(checkpoint_names(store))
    for name in store.listdir(SHARDED_DIR):  # shards whose checkpoint is gone (pruned, or never completed)
        if name not in kept:
            store.remove(f"{SHARDED_DIR}/{name}", recursive=True)
