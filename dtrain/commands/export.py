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
                    "weights_only=True) then model.load_state_dict() in one process.")
    export.add_argument("path", type=Path, help="a run dir, its checkpoints/ dir, or one checkpoint (step-N); a run "
                                                "or checkpoints dir means its latest complete checkpoint")
    export.add_argument("-o", "--output", type=Path, default=Path("model.pt"),
                        help="the file to write (default ./model.pt)")
    export.set_defaults(handler=run_export)
    return export


def run_export(args: argparse.Namespace) -> int:
    step = export_model(args.path, args.output)
    print(f"dtrain export: wrote {args.output} (the model after batch {step})")
    return ExitCode.OK


def export_model(path: Path, output: Path) -> int:
    """Write the plain model state of the checkpoint `path` names to `output`; return its step."""
    import torch

    from dtrain.train import checkpoint as ckpt

    ref = _checkpoint_at(path)
    state = torch.load(ref.path / ckpt.STATE_FILE, weights_only=True)
    sharded = state.get("sharded")
    if sharded is None:
        model_state = torch.load(ref.path / ckpt.MODEL_FILE, weights_only=True)
    else:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        shards = ref.path.parent / sharded
        if not shards.is_dir():
            raise CheckpointError(f"checkpoint {ref.path} names shards in {shards}, which is missing; export "
                                  "another checkpoint of the run")
        with tempfile.TemporaryDirectory(prefix="dtrain-export-") as tmp:
            joined = Path(tmp) / "joined.pt"
            dcp_to_torch_save(str(shards), str(joined))
            model_state = torch.load(joined, weights_only=True)["model"]
    output.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model_state, output)
    return ref.step


def _checkpoint_at(path: Path) -> Any:
    from dtrain.train import checkpoint as ckpt

    if (path / ckpt.META_FILE).is_file():
        return ckpt.verify_checkpoint(path)
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    ref = ckpt.find_resume_checkpoint(root)
    if ref is None:
        raise CheckpointError(f"no checkpoint in {path}; give a run dir, its checkpoints/ dir or a step-N dir")
    return ref
