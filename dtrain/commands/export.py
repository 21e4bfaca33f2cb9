"""`dtrain export`: a plain `model.pt` from a run's checkpoint, for one process to load with `load_state_dict`.

A sharded run's checkpoint (strategy fsdp) holds its weights as shards that every rank wrote through
torch.distributed.checkpoint; this joins them in one process (`dcp_to_torch_save`, no process group). Other
checkpoints already hold a plain `model.pt`, which is copied.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from dtrain.errors import CheckpointError, ExitCode


def register(subcommands: Any) -> argparse.ArgumentParser:
    export = subcommands.add_parser(
        "export", help="write a plain model.pt from a run's checkpoint (joins a sharded run's shards)",
        description="Write the model of a checkpoint as one plain state_dict file: torch.load(path, "
                    "weights_only=True) then model.load_state_dict() in one process. Checkpoints in object storage "
                    "are read through the run dir (run.json says where they are) or an s3://, gs:// or az:// URL "
                    "(credentials and AWS_ENDPOINT_URL from the environment).")
    export.add_argument("path", help="a run dir, its checkpoints/ dir, or one checkpoint (step-N), or the URL of a "
                                     "run's checkpoints or of one of them; a run or checkpoints dir means its latest "
                                     "complete checkpoint")
    export.add_argument("-o", "--output", type=Path, default=Path("model.pt"),
                        help="the file to write (default ./model.pt)")
    export.set_defaults(handler=run_export)
    return export


def run_export(args: argparse.Namespace) -> int:
    step = export_model(args.path, args.output)
    print(f"dtrain export: wrote {args.output} (the model after batch {step})")
    return ExitCode.OK


def export_model(path: str | Path, output: Path) -> int:
    """Write the plain model state of the checkpoint `path` names to `output`; return its step."""
    import torch

    from dtrain.train import checkpoint as ckpt

    ref = _checkpoint_at(str(path))
    store, _ = ref.located()
    state = ckpt.load_state_file(ref)
    sharded = state.get("sharded")
    if sharded is None:
        model_state = ckpt.load_checkpoint(ref)[0]
    else:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        if not store.exists(f"{sharded}/{ckpt.DCP_MARKER}"):
            raise CheckpointError(f"checkpoint {ref.path} names shards in {store.describe(sharded)}, which are "
                                  "missing or incomplete; export another checkpoint of the run")
        with tempfile.TemporaryDirectory(prefix="dtrain-export-") as tmp:
            shards = store.local_path(sharded) if store.is_local else Path(tmp) / "shards"
            if not store.is_local:
                store.download(sharded, shards)
            joined = Path(tmp) / "joined.pt"
            dcp_to_torch_save(str(shards), str(joined))
            model_state = torch.load(joined, weights_only=True)["model"]
    output.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model_state, output)
    return ref.step


def _checkpoint_at(path: str) -> Any:
    from dtrain.runs.rundir import RUN_FILE, load_run_info
    from dtrain.runs.storage import CheckpointStore, store_for_url, with_secrets
    from dtrain.train import checkpoint as ckpt

    if "://" in path:
        store = store_for_url(path.rstrip("/"))
    elif (Path(path) / RUN_FILE).is_file():  # a run dir: its checkpoints wherever run.json says they went
        store = with_secrets(load_run_info(Path(path)).checkpoints)
    elif (Path(path) / "checkpoints").is_dir():
        store = CheckpointStore(url=str(Path(path, "checkpoints").resolve()))
    else:
        store = CheckpointStore(url=str(Path(path).resolve()))
    if store.exists(ckpt.META_FILE):  # one checkpoint: its folder's name under its parent
        parent, name = store.url.rsplit("/", 1)
        return ckpt.verify_checkpoint(name, CheckpointStore(url=parent, options=store.options))
    ref = ckpt.find_resume_checkpoint(store)
    if ref is None:
        raise CheckpointError(f"no checkpoint in {path}; give a run dir, its checkpoints/ dir, a step-N dir or the "
                              "URL of one")
    return ref
