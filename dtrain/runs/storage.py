"""Checkpoint storage: the one layer through which checkpoints are written, listed, read and deleted, on a local
folder or in object storage (S3, GCS, Azure) alike, through fsspec.

A run's checkpoints live under one root: the run dir's `checkpoints/` (type `directory` without
`container_path`, the default) or `<base>/<run key>/` where the base is `container_path`, `shared_fs`'s
`host_path/storage_path`, or `s3://bucket/prefix`, `gs://bucket/prefix`, `az://container/prefix`. The run key
(the experiment's name and a random suffix) is chosen when the run dir is created and kept in `run.json`, so a
resume finds the same root. Secrets never enter a `CheckpointStore`'s options that are written anywhere: the
workers read them from the environment (config/storage.py, SECRET_ENVIRONMENT).
"""

from __future__ import annotations

import importlib.util
import os
import posixpath
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import IO, Any

from dtrain.config import StorageSection
from dtrain.config.storage import AzureStorage, DirectoryStorage, S3Storage, SharedFsStorage
from dtrain.errors import CheckpointError, ConfigError

# fsspec protocol of each object-storage type, and the package that gives fsspec that protocol.
PROTOCOLS = {"s3": ("s3", "s3fs", "pip install 'dtrain[s3]' (s3fs)"),
             "gcs": ("gs", "gcsfs", "pip install gcsfs"),
             "azure": ("az", "adlfs", "pip install adlfs")}


@dataclass(frozen=True)
class CheckpointStore:
    """Where one run's checkpoints live (`url`: a local folder or `s3://bucket/prefix/key`) and the fsspec options
    that reach it (an endpoint; never a secret). Names below it are relative, `/`-separated."""

    url: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def is_local(self) -> bool:
        return "://" not in self.url

    @cached_property
    def fs(self) -> Any:
        """The fsspec filesystem (listings are never cached: another process may have written since)."""
        import fsspec

        if self.is_local:
            return fsspec.filesystem("file")
        protocol = self.url.split("://", 1)[0]
        return fsspec.filesystem(protocol, use_listings_cache=False, skip_instance_cache=True, **self.options)

    def path(self, name: str = "") -> str:
        """The filesystem path of `name` under the root (a local path, or `bucket/prefix/key/name`)."""
        root = self.url if self.is_local else self.url.split("://", 1)[1]
        return posixpath.join(root, name) if name else root

    def describe(self, name: str = "") -> str:
        """`name` as a person reads it: a local path or a URL."""
        return posixpath.join(self.url, name) if name else self.url

    def local_path(self, name: str = "") -> Path:
        """A name under a local root as a Path (only for a local store)."""
        assert self.is_local, f"{self.url} is not a local folder"
        return Path(self.path(name))

    def exists(self, name: str) -> bool:
        return bool(self.fs.exists(self.path(name)))

    def listdir(self, name: str = "") -> list[str]:
        """The names of the entries directly under `name` ([] when it does not exist)."""
        try:
            entries = self.fs.ls(self.path(name), detail=False)
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(str(entry).rstrip("/")) for entry in entries)

    def size(self, name: str) -> int:
        return int(self.fs.size(self.path(name)))

    def read_bytes(self, name: str) -> bytes:
        with self.fs.open(self.path(name), "rb") as handle:
            return bytes(handle.read())

    @contextmanager
    def open(self, name: str, mode: str = "rb") -> Iterator[IO[bytes]]:
        with self.fs.open(self.path(name), mode) as handle:
            yield handle

    def write_bytes(self, name: str, data: bytes) -> None:
        """One object (on object storage a single PUT: whole or absent)."""
        if self.is_local:
            self.local_path(name).parent.mkdir(parents=True, exist_ok=True)
        self.fs.pipe_file(self.path(name), data)

    def upload(self, local: Path, name: str) -> None:
        self.fs.put_file(str(local), self.path(name))

    def download(self, name: str, local: Path) -> None:
        """A file or a folder (recursively) to the local `local`."""
        self.fs.get(self.path(name).rstrip("/") + ("/" if self.fs.isdir(self.path(name)) else ""), str(local),
                    recursive=True)

    def remove(self, name: str, *, recursive: bool = False) -> None:
        """Delete a file or (recursive) a folder; a missing one is no error."""
        try:
            self.fs.rm(self.path(name), recursive=recursive)
        except FileNotFoundError:
            pass

    def dcp_writer(self, name: str) -> Any:
        """torch.distributed.checkpoint's writer for the folder `name` (every rank writes its own shard files)."""
        import torch.distributed.checkpoint as dcp

        if self.is_local:
            return dcp.FileSystemWriter(self.path(name))
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return FsspecWriter(self.describe(name), **self._dcp_options())

    def dcp_reader(self, name: str) -> Any:
        """torch.distributed.checkpoint's reader of the folder `name`."""
        import torch.distributed.checkpoint as dcp

        if self.is_local:
            return dcp.FileSystemReader(self.path(name))
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(self.describe(name), **self._dcp_options())

    def _dcp_options(self) -> dict[str, Any]:
        return {**self.options, "use_listings_cache": False, "skip_instance_cache": True}

    def to_json(self) -> dict[str, Any]:
        """What run.json keeps to find the store again (no secrets: options hold only endpoints)."""
        return {"url": self.url, "options": dict(self.options)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CheckpointStore:
        return cls(url=str(data["url"]), options=dict(data.get("options") or {}))


@dataclass(frozen=True)
class ShardFolder:
    """A folder of a store that every rank writes its shards into through torch.distributed.checkpoint."""

    store: CheckpointStore
    name: str

    def writer(self) -> Any:
        return self.store.dcp_writer(self.name)

    def reader(self) -> Any:
        return self.store.dcp_reader(self.name)

    def __str__(self) -> str:
        return self.store.describe(self.name)


def run_key(experiment_name: str) -> str:
    """A new run's folder name under a shared storage base: its experiment's name and a random suffix."""
    cleaned = re.sub(r"[^A-Za-z0-9_.-]", "_", experiment_name).strip("._") or "experiment"
    return f"{cleaned}-{uuid.uuid4().hex[:12]}"


def base_url(section: StorageSection) -> str | None:
    """The folder or URL under which each run gets its folder; None for the run dir's own `checkpoints/`."""
    if isinstance(section, DirectoryStorage):
        path = section.container_path
        return str(Path(path).expanduser().resolve()) if path else None
    if isinstance(section, SharedFsStorage):
        return str(Path(section.folder).expanduser().resolve())
    protocol = PROTOCOLS[section.type][0]
    bucket = getattr(section, "container" if isinstance(section, AzureStorage) else "bucket")
    prefix = (getattr(section, "prefix", None) or "").strip("/")
    return f"{protocol}://{bucket}/{prefix}" if prefix else f"{protocol}://{bucket}"


def storage_options(section: StorageSection) -> dict[str, Any]:
    """fsspec options for the section's type that are safe to record (endpoints and account names); secrets come
    from `secret_options`."""
    if isinstance(section, S3Storage) and section.endpoint_url:
        return {"endpoint_url": section.endpoint_url}
    if isinstance(section, AzureStorage) and section.account_url:
        host = re.sub(r"^https?://", "", section.account_url).strip("/")
        return {"account_name": host.split(".", 1)[0], "account_host": host}
    return {}


def secret_options(kind: str, environ: os._Environ[str] | dict[str, str] | None = None) -> dict[str, Any]:
    """The credentials the launcher put in the environment (config/storage.py SECRET_ENVIRONMENT), as fsspec
    options of type `kind`; s3fs and adlfs read their usual variables themselves as well."""
    env = os.environ if environ is None else environ
    if kind == "s3" and env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        return {"key": env["AWS_ACCESS_KEY_ID"], "secret": env["AWS_SECRET_ACCESS_KEY"]}
    if kind == "azure":
        found = {}
        if env.get("AZURE_STORAGE_CONNECTION_STRING"):
            found["connection_string"] = env["AZURE_STORAGE_CONNECTION_STRING"]
        if env.get("AZURE_STORAGE_CREDENTIAL"):
            found["credential"] = env["AZURE_STORAGE_CREDENTIAL"]
        return found
    return {}


def new_store(section: StorageSection, run_dir: Path, experiment_name: str) -> CheckpointStore:
    """The store of a new run: the run dir's `checkpoints/`, or a new folder of its own under the section's base."""
    base = base_url(section)
    if base is None:
        return CheckpointStore(url=str((run_dir / "checkpoints").resolve()))
    return CheckpointStore(url=posixpath.join(base, run_key(experiment_name)), options=storage_options(section))


def with_secrets(store: CheckpointStore) -> CheckpointStore:
    """The same store with the environment's credentials in its (in-memory) options."""
    if store.is_local:
        return store
    kind = {protocol: kind for kind, (protocol, _, _) in PROTOCOLS.items()}.get(store.url.split("://", 1)[0], "")
    return CheckpointStore(url=store.url, options={**store.options, **secret_options(kind)})


def store_for_url(url: str) -> CheckpointStore:
    """A store at a URL someone typed (`dtrain export s3://...`): credentials and, for S3, `AWS_ENDPOINT_URL` from
    the environment."""
    protocol = url.split("://", 1)[0]
    options: dict[str, Any] = {}
    if protocol == "s3" and os.environ.get("AWS_ENDPOINT_URL"):
        options["endpoint_url"] = os.environ["AWS_ENDPOINT_URL"]
    return with_secrets(CheckpointStore(url=url, options=options))


def require_library(section: StorageSection) -> None:
    """One line naming the package to install when the section's type needs one that is absent."""
    if section.type not in PROTOCOLS:
        return
    _, package, install = PROTOCOLS[section.type]
    if importlib.util.find_spec(package) is None:
        raise ConfigError(f"checkpoint_storage.type {section.type} needs the {package} package, which is not "
                          f"installed; {install}, or use type directory or shared_fs")


def prepare_storage(section: StorageSection) -> None:
    """Before any worker starts: the client library is there, the section's secrets are in this process's
    environment for the workers it starts (never in a file), and the storage's base can be written."""
    require_library(section)
    os.environ.update(section.secrets())
    base = base_url(section)
    if base is not None:
        check_reachable(with_secrets(CheckpointStore(url=base, options=storage_options(section))))


def check_reachable(store: CheckpointStore) -> None:
    """Write, read back and delete a small probe object under the store's root, so that an unreachable endpoint,
    wrong credentials or a missing bucket stop the run with one line before training starts."""
    if store.is_local:
        try:
            Path(store.path()).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"checkpoint storage {store.url} cannot be created ({exc.strerror}); give a "
                                  "folder this user can write") from None
        return
    probe = f".dtrain-probe-{uuid.uuid4().hex[:8]}"
    try:
        store.write_bytes(probe, b"probe")
        if store.read_bytes(probe) != b"probe":
            raise OSError("the probe object read back differs")
        store.remove(probe)
    except Exception as exc:  # botocore, aiohttp and fsspec raise many kinds; each means "cannot checkpoint there"
        raise CheckpointError(f"checkpoint storage {store.url} cannot be written: {explain_storage_error(exc)}") \
            from None


def explain_storage_error(exc: BaseException) -> str:
    """One line for a storage error: what went wrong and what to change."""
    text = " ".join(str(exc).split())[:200]
    name = type(exc).__name__
    if isinstance(exc, FileNotFoundError) or "NoSuchBucket" in text:
        return f"the bucket does not exist ({name}: {text}); create it or fix checkpoint_storage.bucket"
    if isinstance(exc, PermissionError) or any(code in text for code in (
            "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "Forbidden", "403")):
        return (f"access denied ({name}: {text}); check checkpoint_storage.access_key/secret_key or the AWS "
                "environment's credentials")
    if any(word in text for word in ("Could not connect", "Connect", "connect", "Name or service", "timed out")):
        return f"the endpoint cannot be reached ({name}: {text}); check checkpoint_storage.endpoint_url"
    return f"{name}: {text}"
