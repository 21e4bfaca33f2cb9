"""The `checkpoint_storage` section: where checkpoints go, as Determined's experiment file names it, picked by
`type` (a pydantic discriminated union): `directory`, `shared_fs`, `s3`, `gcs` or `azure`.

Every type keeps the same counts (`save_trial_latest`, `save_trial_best`). Secrets (`access_key`, `secret_key`,
`connection_string`, `credential`) are read from the file but never written out again: they dump as null, so
`config.yaml`, the run store and the logs never hold them; the launcher hands them to its workers through the
environment (`SECRET_ENVIRONMENT`).
"""

from __future__ import annotations

import posixpath
from typing import Annotated, Any, Literal, get_args

from pydantic import Field, SecretStr, field_serializer, model_validator

from dtrain.config.base import DETERMINED_ONLY, Section

_KEEP_LATEST = "checkpoints kept: the newest N (resume starts from the newest)"
_KEEP_BEST = "checkpoints kept: the best M by the searcher's metric"
_PREFIX = "folder inside the bucket under which each run gets its own folder (no `..`)"

# Where the launcher puts each secret for its workers (config.yaml holds null in its place).
SECRET_ENVIRONMENT = {"access_key": "AWS_ACCESS_KEY_ID", "secret_key": "AWS_SECRET_ACCESS_KEY",
                      "connection_string": "AZURE_STORAGE_CONNECTION_STRING", "credential": "AZURE_STORAGE_CREDENTIAL"}


class StorageSection(Section):
    """Where checkpoints go and how many are kept (Determined's `checkpoint_storage`)."""

    type: str = Field(description="where checkpoints go")
    save_experiment_best: int = Field(default=0, ge=0, description=DETERMINED_ONLY + " (one experiment runs one "
                                                                   "trial)")
    save_trial_best: int = Field(default=1, ge=0, description=_KEEP_BEST)
    save_trial_latest: int = Field(default=1, ge=1, description=_KEEP_LATEST)

    def secrets(self) -> dict[str, str]:
        """The secrets this section holds, by the environment variable the workers read them from."""
        found = {}
        for key, variable in SECRET_ENVIRONMENT.items():
            value = getattr(self, key, None)
            if isinstance(value, SecretStr) and value.get_secret_value():
                found[variable] = value.get_secret_value()
        return found


class DirectoryStorage(StorageSection):
    """`directory`: a folder; without `container_path`, the run dir's `checkpoints/` (dtrain's default)."""

    type: Literal["directory"] = Field(default="directory", description="where checkpoints go")
    container_path: str | None = Field(default=None, description="folder under which each run gets its own "
                                       "folder of checkpoints; default: the run dir's `checkpoints/`")


class SharedFsStorage(StorageSection):
    """`shared_fs`: a folder every node mounts; checkpoints go under `host_path/storage_path` as in Determined."""

    type: Literal["shared_fs"] = Field(default="shared_fs", description="where checkpoints go")
    host_path: str = Field(description="the shared folder (as every node sees it)")
    storage_path: str | None = Field(default=None, description="a folder under `host_path` (relative, or absolute "
                                     "and inside `host_path`); checkpoints go there, default `host_path` itself")
    container_path: str | None = Field(default=None, description=DETERMINED_ONLY + " (dtrain runs no containers)")
    propagation: str | None = Field(default=None, description=DETERMINED_ONLY)
    checkpoint_path: str | None = Field(default=None, description=DETERMINED_ONLY + " (legacy key)")
    tensorboard_path: str | None = Field(default=None, description=DETERMINED_ONLY + " (legacy key)")

    @model_validator(mode="after")
    def _storage_path_inside(self) -> SharedFsStorage:
        if self.storage_path is not None and posixpath.isabs(self.storage_path):
            inside = posixpath.normpath(self.storage_path) + "/"
            if not inside.startswith(posixpath.normpath(self.host_path).rstrip("/") + "/"):
                raise ValueError(f"checkpoint_storage.storage_path ({self.storage_path}) is absolute and not inside "
                                 f"host_path ({self.host_path}); give a path relative to host_path or one inside it")
        if self.storage_path is not None and ".." in self.storage_path.split("/"):
            raise ValueError(f"checkpoint_storage.storage_path ({self.storage_path}) holds `..`; give a folder inside "
                             "host_path")
        return self

    @property
    def folder(self) -> str:
        """`host_path/storage_path`, where Determined writes this storage's checkpoints."""
        return posixpath.join(self.host_path, self.storage_path) if self.storage_path else self.host_path


def _no_dots(prefix: str | None) -> str | None:
    if prefix is not None and ".." in prefix.split("/"):
        raise ValueError(f"checkpoint_storage.prefix ({prefix}) holds `..`; give a plain folder name like team/runs")
    return prefix


def _bucket_name(bucket: str) -> str:
    if len(bucket) < 3 or "/" in bucket:
        raise ValueError(f"checkpoint_storage.bucket ({bucket!r}) is not a bucket name (3 characters or more, no "
                         "`/`); put folders in `prefix`")
    return bucket


class ObjectStorage(StorageSection):
    """What every object-storage type has: whether checkpoints upload in the background."""

    background_upload: bool = Field(default=False, description="upload each checkpoint on a background thread "
                                    "while training goes on (a snapshot in host memory is taken first; at most one "
                                    "upload in flight, a kill loses only that one); false: training waits for each "
                                    "upload (the default: on shared CPUs the background upload measured slower)")


class S3Storage(ObjectStorage):
    """`s3`: an S3 bucket, or any S3-compatible server through `endpoint_url` (needs `pip install 'dtrain[s3]'`).
    Credentials: `access_key`/`secret_key`, else the usual AWS environment (`AWS_ACCESS_KEY_ID`, a profile...)."""

    type: Literal["s3"] = Field(default="s3", description="where checkpoints go")
    bucket: str = Field(description="the bucket")
    prefix: str | None = Field(default=None, description=_PREFIX)
    endpoint_url: str | None = Field(default=None, description="an S3-compatible server's URL; default AWS (or "
                                     "`AWS_ENDPOINT_URL`)")
    access_key: SecretStr | None = Field(default=None, description="access key id (never written to config.yaml, "
                                         "logs or the store); default the AWS environment")
    secret_key: SecretStr | None = Field(default=None, description="secret access key (never written out); default "
                                         "the AWS environment")

    @model_validator(mode="after")
    def _names(self) -> S3Storage:
        _bucket_name(self.bucket)
        _no_dots(self.prefix)
        if (self.access_key is None) != (self.secret_key is None):
            raise ValueError("checkpoint_storage.access_key and secret_key go together; give both or neither (the "
                             "AWS environment then supplies them)")
        return self

    @field_serializer("access_key", "secret_key")
    def _never_written(self, _value: SecretStr | None) -> None:
        return None


class GcsStorage(ObjectStorage):
    """`gcs`: a Google Cloud Storage bucket through fsspec's gcsfs (`pip install gcsfs`; not tested here)."""

    type: Literal["gcs"] = Field(default="gcs", description="where checkpoints go")
    bucket: str = Field(description="the bucket")
    prefix: str | None = Field(default=None, description=_PREFIX)

    @model_validator(mode="after")
    def _names(self) -> GcsStorage:
        _bucket_name(self.bucket)
        _no_dots(self.prefix)
        return self


class AzureStorage(ObjectStorage):
    """`azure`: an Azure Blob Storage container through fsspec's adlfs (`pip install adlfs`; not tested here)."""

    type: Literal["azure"] = Field(default="azure", description="where checkpoints go")
    container: str = Field(description="the blob container")
    connection_string: SecretStr | None = Field(default=None, description="the account's connection string (never "
                                                "written out); or give `account_url`")
    account_url: str | None = Field(default=None, description="https://ACCOUNT.blob.core.windows.net; or give "
                                    "`connection_string`")
    credential: SecretStr | None = Field(default=None, description="account key or SAS token for `account_url` "
                                         "(never written out)")
    prefix: str | None = Field(default=None, description=_PREFIX)

    @model_validator(mode="after")
    def _one_account(self) -> AzureStorage:
        if (self.connection_string is None) == (self.account_url is None):
            raise ValueError("checkpoint_storage needs exactly one of connection_string and account_url for type "
                             "azure")
        if self.credential is not None and self.connection_string is not None:
            raise ValueError("checkpoint_storage.credential goes with account_url, not with connection_string (which "
                             "holds its own key)")
        _no_dots(self.prefix)
        return self

    @field_serializer("connection_string", "credential")
    def _never_written(self, _value: SecretStr | None) -> None:
        return None


CheckpointStorage = Annotated[
    DirectoryStorage | SharedFsStorage | S3Storage | GcsStorage | AzureStorage,
    Field(discriminator="type"),
]

# Each storage type's section by its name, in the order the union lists them.
STORAGE_TYPES: dict[str, type[StorageSection]] = {
    variant.model_fields["type"].default: variant for variant in get_args(get_args(CheckpointStorage)[0])}


def storage_by_type(value: Any) -> Any:
    """A section without `type` is `directory` (dtrain's default: the run dir)."""
    if isinstance(value, dict) and "type" not in value:
        return {**value, "type": "directory"}
    return value
