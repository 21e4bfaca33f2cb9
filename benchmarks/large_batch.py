"""Large-batch training that keeps accuracy: final test accuracy against global batch size on Fashion-MNIST for six
recipes, the same epoch budget for all, on 2 workers (the shape of Goyal et al. 2017, Figure 1).

Recipes (every one decays the rate by cosine to 0, starting after its warm-up; the base rates are for batch 128;
SGD's is Goyal et al.'s rule, 0.1 per 256 records, so 0.05 at 128):
  (a) sgd_no_scaling     SGD + momentum 0.9 at the base rate whatever the batch
  (b) sgd_linear         SGD, rate scaled linearly with the batch (Goyal et al.), no warm-up
  (c) sgd_linear_warmup  as (b) with gradual warm-up from the base rate over the first epochs
  (d) lars_warmup        LARS (You et al. 2017), rate scaled by sqrt, warm-up
  (e) lamb_warmup        LAMB (You et al. 2019), rate scaled by sqrt (the LAMB paper's rule), warm-up
  (f) radam              RAdam (Liu et al. 2019), rate scaled by sqrt, no warm-up (its rectification is one)

Every run is a real `dtrain run` of examples/fashion_mnist/distributed.yaml (the demo's CNN) with the recipe as
`large_batch` keys; a global batch above 1024 records is reached by gradient aggregation (per-slot batches of 512,
aggregation_frequency = batch / 1024), so the batch on the x axis is the number of records per optimizer update.
At batch 128, (b) is the same run as (a) and is not repeated. A run whose loss becomes NaN stops with
"training diverged" and is reported as such (plotted at chance, 10 %).

Choosing without the test set. Every run trains on the training set minus 5,000 records held out (a fixed seeded
draw, `hyperparameters.validation_holdout`) and validates on those; the best recipe at each batch is the one with
the best held-out accuracy, and the figures reported are that recipe's accuracy on the test set (its final model,
evaluated here after the run). The test set is never used to choose.

Headline: gap_points_16x and gap_points_64x, the test accuracy at 128 minus that at 2048 and 8192 of the recipes
chosen on the held-out records, in percentage points (targets: <= 1.0 and <= 2.5), and every recipe's accuracy
(test and held-out) at every batch. A grid smaller than the full one says so in the JSON (`grid`); a run reused
from an earlier call with the same --workdir says so and carries the commit it measured.

    python benchmarks/large_batch.py            # 4 batches x 6 recipes, 8 epochs each: about an hour on 2 cores
    python benchmarks/large_batch.py --quick    # batches 128 and 2048, 1 epoch: a few minutes, large_batch_quick.*
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
CONFIG = REPO / "examples" / "fashion_mnist" / "distributed.yaml"
BASE_BATCH = 128
PER_SLOT_LIMIT = 512
WORKERS = 2
MODEL: dict[str, Any] = {"batch_norm": True, "validation_holdout": 5000}  # the demo's CNN, batch norm after each conv
FULL_GRID = ([128, 512, 2048, 8192], ["sgd_no_scaling", "sgd_linear", "sgd_linear_warmup", "lars_warmup", "lamb_warmup",
                                      "radam"])


@dataclass(frozen=True)
class Recipe:
    key: str
    label: str
    optimizer: str
    base_lr: float
    lr_scaling: str
    warmup: bool
    options: dict[str, Any] = field(default_factory=dict)


RECIPES = [
    Recipe("sgd_no_scaling", "(a) SGD, no LR scaling", "sgd", 0.05, "none", False,
           {"momentum": 0.9, "weight_decay": 5e-4}),
    Recipe("sgd_linear", "(b) SGD, linear scaling", "sgd", 0.05, "linear", False,
           {"momentum": 0.9, "weight_decay": 5e-4}),
    Recipe("sgd_linear_warmup", "(c) SGD, linear scaling + warm-up", "sgd", 0.05, "linear", True,
           {"momentum": 0.9, "weight_decay": 5e-4}),
    Recipe("lars_warmup", "(d) LARS + warm-up", "lars", 2.0, "sqrt", True,
           {"momentum": 0.9, "weight_decay": 5e-4, "trust_coefficient": 0.001}),
    Recipe("lamb_warmup", "(e) LAMB + warm-up", "lamb", 0.005, "sqrt", True, {"weight_decay": 0.01}),
    Recipe("radam", "(f) RAdam", "radam", 0.001, "sqrt", False, {"weight_decay": 0.0}),
]


def overrides(recipe: Recipe, batch: int, epochs: int, warmup_epochs: float) -> list[str]:
    """`--set` arguments that turn the demo config into this recipe at this batch (records per update)."""
    per_update_slots = WORKERS * PER_SLOT_LIMIT
    global_batch = min(batch, per_update_slots)
    if batch % global_batch:
        raise SystemExit(f"batch {batch} is not a multiple of {global_batch}; use powers of two")
    values: dict[str, Any] = {
        "hyperparameters.global_batch_size": global_batch,
        **{f"hyperparameters.{k}": v for k, v in MODEL.items()},
        "optimizations.aggregation_frequency": batch // global_batch,
        "searcher.max_length": f"{{epochs: {epochs}}}",
        "min_validation_period": "{batches: 0}",
        "min_checkpoint_period": "{batches: 0}",
        "large_batch.optimizer": recipe.optimizer,
        "large_batch.base_lr": recipe.base_lr,
        "large_batch.lr_scaling": recipe.lr_scaling,
        "large_batch.decay": "cosine",
    }
    if recipe.lr_scaling != "none":
        values["large_batch.base_batch_size"] = BASE_BATCH
    if recipe.warmup:
        values["large_batch.warmup_epochs"] = warmup_epochs
    for key, value in recipe.options.items():
        values[f"large_batch.{key}"] = value
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


def run_one(recipe: Recipe, batch: int, epochs: int, warmup_epochs: float, workdir: Path) -> dict[str, Any]:
    run_dir = workdir / f"{recipe.key}-{batch}"
    env = {k: v for k, v in os.environ.items() if k != "DTRAIN_LAUNCHER"}
    env["DTRAIN_RUNS_ROOT"] = str(workdir / "runs")
    started = time.perf_counter()
    from common import STARTED

    summary_path = run_dir / "summary.json"
    measured = run_dir / "benchmark_commit.json"  # which code this run measured, for a later call to reuse it
    reused = summary_path.exists() and json.loads(summary_path.read_text()).get("status") == "completed"
    if reused:
        result = subprocess.CompletedProcess([], 0, "", "")  # finished in an earlier call with this --workdir
    else:
        result = subprocess.run([sys.executable, "-m", "dtrain.cli", "run", str(CONFIG), "--run-dir", str(run_dir),
                                 *overrides(recipe, batch, epochs, warmup_epochs)],
                                capture_output=True, text=True, env=env)
        if run_dir.is_dir():
            measured.write_text(json.dumps({"commit": STARTED["commit"], "dirty": STARTED["dirty"]}))
    row: dict[str, Any] = {"recipe": recipe.key, "label": recipe.label, "batch": batch, "epochs": epochs,
                           "optimizer": recipe.optimizer, "base_lr": recipe.base_lr, "lr_scaling": recipe.lr_scaling,
                           "warmup_epochs": warmup_epochs if recipe.warmup else 0.0,
                           "process_seconds": time.perf_counter() - started}
    if reused:
        provenance = json.loads(measured.read_text()) if measured.is_file() else {"commit": None, "dirty": None}
        row.update(reused_from_earlier_call=True, commit=provenance["commit"], dirty=provenance["dirty"])
    if result.returncode == 0:
        summary = json.loads((run_dir / "summary.json").read_text())
        row.update(status="completed", accuracy=test_accuracy(Path(summary["checkpoint"])),
                   heldout_accuracy=summary["validation"]["accuracy"],
                   loss=summary["validation"]["loss"], updates=_updates(run_dir),
                   training_seconds=summary["wall_seconds"], samples_per_second=summary["samples_per_second"],
                   peak_lr=_peak_lr(run_dir))
    elif "training diverged" in result.stderr:
        row.update(status="diverged", accuracy=None, detail=_error_line(result.stderr))
    else:
        raise SystemExit(f"{recipe.key} at batch {batch} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return row


def test_accuracy(model_file: Path) -> float:
    """The test-set accuracy of a run's final model (the runs validate on records held out of the training set)."""
    import torch

    sys.path.insert(0, str(CONFIG.parent))
    from model_def import build_cnn  # type: ignore[attr-defined]  # examples/fashion_mnist's

    from dtrain.data import load_fashion_mnist

    model = build_cnn(batch_norm=MODEL["batch_norm"])
    model.load_state_dict(torch.load(model_file, map_location="cpu", weights_only=True))
    model.eval()
    images, labels = load_fashion_mnist("test").tensors
    with torch.no_grad():
        correct = sum(int((model(images[i:i + 1000]).argmax(1) == labels[i:i + 1000]).sum())
                      for i in range(0, len(labels), 1000))
    return correct / len(labels)


def _training_series(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from dtrain.runs.store import RunStore

    run = json.loads((run_dir / "run.json").read_text())
    return RunStore(Path(run["store"])).metric_series(run["trial_id"], "training")


def _updates(run_dir: Path) -> int:
    return len(_training_series(run_dir).get("lr", []))


def _peak_lr(run_dir: Path) -> float:
    return max(value for _, value in _training_series(run_dir).get("lr", [(0, 0.0)]))


def _error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if "training diverged" in line]
    return lines[-1].split("error: ", 1)[-1] if lines else ""


# ------------------------------------------------------------------------------------------- report


def best_at(rows: list[dict[str, Any]], batch: int) -> dict[str, Any] | None:
    """The recipe chosen at `batch`: the best accuracy on the held-out training records (never the test set)."""
    done = [r for r in rows if r["batch"] == batch and r["accuracy"] is not None]
    return max(done, key=lambda r: r["heldout_accuracy"]) if done else None


def headline(rows: list[dict[str, Any]], batches: list[int]) -> dict[str, Any]:
    base = best_at(rows, batches[0])
    result: dict[str, Any] = {"base_batch": batches[0], "best_at_base": _best_summary(base)}
    for batch in batches[1:]:
        times = batch // batches[0]
        best = best_at(rows, batch)
        gap = (base["accuracy"] - best["accuracy"]) * 100 if base and best else None
        result[f"gap_points_{times}x"] = round(gap, 2) if gap is not None else None
        result[f"best_at_{times}x"] = _best_summary(best)
    result["targets"] = {"gap_points_16x": 1.0, "gap_points_64x": 2.5}
    for name, target in result["targets"].items():
        if result.get(name) is not None:
            result[f"{name}_met"] = result[name] <= target
    result["accuracy_percent"] = {
        r["recipe"]: {str(b["batch"]): (round(b["accuracy"] * 100, 2) if b["accuracy"] is not None else "diverged")
                      for b in rows if b["recipe"] == r["recipe"]}
        for r in rows}
    return result


def _best_summary(row: dict[str, Any] | None) -> dict[str, Any] | None:
    return {"recipe": row["recipe"], "accuracy_percent": round(row["accuracy"] * 100, 2),
            "heldout_accuracy_percent": round(row["heldout_accuracy"] * 100, 2)} if row else None


def markdown(rows: list[dict[str, Any]], batches: list[int], head: dict[str, Any], epochs: int,
             warmup_epochs: float, command: str) -> str:
    from common import markdown_table

    def cell(recipe: str, batch: int) -> str:
        row = next((r for r in rows if r["recipe"] == recipe and r["batch"] == batch), None)
        if row is None:
            return "-"
        text = "diverged" if row["accuracy"] is None else f"{row['accuracy'] * 100:.2f}"
        best = best_at(rows, batch)
        return f"**{text}**" if best is not None and best is row else text

    recipes = [r for r in RECIPES if any(row["recipe"] == r.key for row in rows)]
    table = markdown_table(["recipe", "optimizer, base lr @128, scaling", *[f"batch {b}" for b in batches]],
                           [[r.label, f"{r.optimizer} {r.base_lr:g}, {r.lr_scaling}"
                             + (f" + {warmup_epochs:g}-epoch warm-up" if r.warmup else ""),
                             *[cell(r.key, b) for b in batches]] for r in recipes])
    gaps = ", ".join(f"{k} = {v}" for k, v in head.items() if k.startswith("gap_points"))
    details = markdown_table(["recipe", "batch", "status", "test accuracy", "held-out accuracy", "held-out loss",
                              "updates", "peak lr", "samples/s"],
                             [[r["recipe"], r["batch"], r["status"], r.get("accuracy") or "-",
                               r.get("heldout_accuracy") or "-", r.get("loss") or "-",
                               r.get("updates", "-"), r.get("peak_lr", "-"), r.get("samples_per_second", "-")]
                              for r in rows])
    return (f"# large_batch\n\nFinal Fashion-MNIST test accuracy (%) of the demo CNN after {epochs} epochs on "
            f"{WORKERS} workers, by records per optimizer update; in bold the recipe chosen per batch on 5,000 "
            "records held out of the training set (not on the test set). Every recipe decays the rate by cosine "
            "after its warm-up.\n\n"
            f"**{gaps}** (points below the best at batch {batches[0]}; targets 1.0 at 16x, 2.5 at 64x)\n\n"
            f"{table}\n\n![accuracy against batch size](large_batch.png)\n\n## Every run\n\n{details}\n\n"
            f"Reproduce: `{command}`\n")


def plot(rows: list[dict[str, Any]], batches: list[int], path: Path, epochs: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for recipe in RECIPES:
        mine = sorted((r for r in rows if r["recipe"] == recipe.key), key=lambda r: r["batch"])
        if not mine:
            continue
        xs = [r["batch"] for r in mine]
        ys = [r["accuracy"] * 100 if r["accuracy"] is not None else 10.0 for r in mine]
        line = axes.plot(xs, ys, marker="o", label=recipe.label)[0]
        diverged = [(x, y) for x, y, r in zip(xs, ys, mine, strict=True) if r["accuracy"] is None]
        if diverged:
            diverged_x, diverged_y = zip(*diverged, strict=True)
            axes.scatter(diverged_x, diverged_y, marker="x", s=80, color=line.get_color())
    axes.set_xscale("log", base=2)
    axes.set_xticks(batches, [str(b) for b in batches])
    axes.set_xlabel("global batch (records per update)")
    axes.set_ylabel("test accuracy (%)")
    done = [r["accuracy"] * 100 for r in rows if r["accuracy"] is not None]
    if done:
        axes.set_ylim(max(min(done) - 2, 0), min(max(done) + 1, 100))
    axes.set_title(f"Fashion-MNIST, {epochs} epoch{'s' if epochs != 1 else ''} each, {WORKERS} workers"
                   + (" (x: diverged)" if any(r["accuracy"] is None for r in rows) else ""))
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="batches 128 and 2048, 1 epoch; writes large_batch_quick.*")
    parser.add_argument("--epochs", type=int, help="epochs per run, the same for all (default 8; 1 with --quick)")
    parser.add_argument("--warmup-epochs", type=float,
                        help="warm-up length for (c), (d), (e) (default 2; 0.25 with --quick)")
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")],
                        help="comma-separated batch sizes, the first is the base (default 128,512,2048,8192)")
    parser.add_argument("--recipes", type=lambda s: s.split(","),
                        help=f"comma-separated subset of: {', '.join(r.key for r in RECIPES)}")
    parser.add_argument("--name", help="result file name (default large_batch, or large_batch_quick)")
    parser.add_argument("--workdir", type=Path,
                        help="keep the run dirs here; runs completed there by an earlier call are reused "
                             "(default: a temporary dir)")
    args = parser.parse_args()

    from common import RESULTS, machine_info, write_results

    epochs = args.epochs or (1 if args.quick else 8)
    warmup_epochs = args.warmup_epochs if args.warmup_epochs is not None else (0.25 if args.quick else 2.0)
    batches = args.batches or ([128, 2048] if args.quick else [128, 512, 2048, 8192])
    recipes = [r for r in RECIPES if args.recipes is None or r.key in args.recipes]
    name = args.name or ("large_batch_quick" if args.quick else "large_batch")
    unknown = set(args.recipes or []) - {r.key for r in RECIPES}
    if unknown:
        parser.error(f"unknown recipes {sorted(unknown)}; choose from {', '.join(r.key for r in RECIPES)}")
    with tempfile.TemporaryDirectory(prefix="dtrain-large-batch-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        rows: list[dict[str, Any]] = []
        plan = [(recipe, batch) for batch in batches for recipe in recipes]
        for index, (recipe, batch) in enumerate(plan, start=1):
            same = _same_run(recipe, batch, rows)
            if same is not None:
                row = dict(same, recipe=recipe.key, label=recipe.label, same_run_as=same["recipe"])
            else:
                row = run_one(recipe, batch, epochs, warmup_epochs, workdir)
            rows.append(row)
            shown = "diverged" if row["accuracy"] is None else f"{row['accuracy'] * 100:.2f} %"
            print(f"[{index}/{len(plan)}] {recipe.label} at batch {batch}: {shown} "
                  f"({row['process_seconds']:.0f} s{', same run as ' + row['same_run_as'] if same else ''})",
                  flush=True)
    head = headline(rows, batches)
    command = " ".join(["python benchmarks/large_batch.py", *sys.argv[1:]])
    RESULTS.mkdir(parents=True, exist_ok=True)
    plot(rows, batches, RESULTS / f"{name}.png", epochs)
    text = markdown(rows, batches, head, epochs, warmup_epochs, command).replace("large_batch.png", f"{name}.png")
    full = batches == FULL_GRID[0] and [r.key for r in recipes] == FULL_GRID[1] and epochs == 8
    grid = {"batches": batches, "recipes": [r.key for r in recipes], "epochs": epochs, "full_grid": full,
            "note": None if full else f"a reduced grid (the full one is batches {FULL_GRID[0]}, all six recipes, 8 "
                                      "epochs: about an hour on an idle 2-core machine)",
            "reused_rows": sum(1 for r in rows if r.get("reused_from_earlier_call"))}
    path = write_results(name, head, rows, text, machine_info(),
                         extra={"epochs": epochs, "workers": WORKERS, "warmup_epochs": warmup_epochs, "grid": grid})
    print(json.dumps({k: v for k, v in head.items() if k != "accuracy_percent"}, indent=2))
    print(f"results: {path} and {path.with_suffix('.md')}, plot {RESULTS / (name + '.png')}")


def _same_run(recipe: Recipe, batch: int, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """At the base batch, linear scaling without warm-up is the same run as no scaling: reuse it."""
    if recipe.key != "sgd_linear" or batch != BASE_BATCH:
        return None
    return next((r for r in rows if r["recipe"] == "sgd_no_scaling" and r["batch"] == batch), None)


if __name__ == "__main__":
    main()
