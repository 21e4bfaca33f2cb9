"""HSDP against FSDP2 and DDP on the 2 x 2 emulated cluster (benchmarks/cluster.py: 2 network namespaces x 2
workers, the link between them capped by tbf), paired round by round (A B C, C B A, ...):

- `hsdp_over_fsdp_step_ratio`: the seconds of a training step under `distributed.strategy: hsdp` (FSDP2 sharded
  inside each node, replicated across) over FSDP2 sharded over all 4 workers. HSDP keeps the all-gathers and the
  reduce-scatter inside a node and sends only 1/2 of the gradient bytes (an all-reduce of each rank's shard)
  across the link, so it should be below 1 whenever the link is the bottleneck;
- `hsdp_over_ddp_step_ratio`: the same against DDP (`allreduce`), which holds the whole model state on every
  worker and all-reduces the whole gradient across the link;
- beside them, `dtrain plan`'s bytes per rank per step within a node and across nodes for each layout.

The model is the wide MLP of examples/wide_mlp at width 512 (4 blocks, 2.2 M parameters, fp32 Adam), so that a
step's collectives over a 200 Mbit/s link take about as long as its compute. A step's time is the run's
training seconds over its steps (`summary.json`: global batch / samples per second).

    flock /tmp/dtrain-bench.lock .venv/bin/python benchmarks/hsdp_cluster.py              # 3 rounds, ~20 min
    flock /tmp/dtrain-bench.lock .venv/bin/python benchmarks/hsdp_cluster.py --quick      # ~5 min, 1 round
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
CONFIG = ROOT / "examples" / "wide_mlp" / "fsdp.yaml"
PORTS = iter(range(29800, 29900))
GLOBAL_BATCH = 64
VARIANTS = {"hsdp": ["distributed.strategy=hsdp"], "fsdp": ["distributed.strategy=fsdp"],
            "ddp": ["distributed.strategy=allreduce"]}


def log(message: str) -> None:
    print(f"[hsdp_cluster {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def plan_traffic(parameters: int, ranks: int, per_node: int) -> dict[str, dict[str, float]]:
    """`dtrain plan`'s bytes per rank per step (within a node, across nodes) for each layout."""
    from dtrain.plan.memory import step_traffic

    return {layout: {"within_node": t.within_node_bytes, "across_nodes": t.across_nodes_bytes}
            for layout in ("hsdp", "fsdp", "ddp")
            for t in [step_traffic(4.0 * parameters, layout, ranks, per_node)]}


def measure(rounds: int, steps: int, rate: str, workdir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from cluster import emulated_cluster
    from common import alternate, ratio_headline, rounds_of

    base = ["resources.slots_per_trial=4", "hyperparameters.width=512", "hyperparameters.blocks=4",
            f"hyperparameters.global_batch_size={GLOBAL_BATCH}", f"searcher.max_length={{batches: {steps}}}",
            f"scheduling_unit={steps}", "min_validation_period={batches: 0}", "min_checkpoint_period={batches: 0}",
            "checkpoint_policy=none", "reproducibility.experiment_seed=0"]
    with emulated_cluster(nodes=2, rate=rate) as cluster:
        def runner(label: str) -> Any:
            def run(repeat: int) -> dict[str, Any]:
                summary = cluster.train(CONFIG, [*base, *VARIANTS[label]], workdir / f"{label}-{repeat}", next(PORTS))
                return {"step_s": GLOBAL_BATCH / summary["samples_per_second"],
                        "strategy": summary["strategy"], "steps": summary["steps_completed"]}
            return run

        rows = alternate([(label, runner(label)) for label in VARIANTS], rounds, log)
    hsdp, fsdp, ddp = (rounds_of(rows, label, "step_s") for label in ("hsdp", "fsdp", "ddp"))
    width, blocks, inputs, classes = 512, 4, 256, 10
    parameters = inputs * width + width + blocks * 2 * (width * width + width) + width * classes + classes
    headline = {**ratio_headline("hsdp_over_fsdp_step_ratio", hsdp, fsdp),
                **ratio_headline("hsdp_over_ddp_step_ratio", hsdp, ddp),
                "step_s_median": {label: sorted(values)[len(values) // 2]
                                  for label, values in (("hsdp", hsdp), ("fsdp", fsdp), ("ddp", ddp))},
                "parameters": parameters, "plan_bytes_per_rank_per_step": plan_traffic(parameters, 4, 2)}
    return headline, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three variants (default 3)")
    parser.add_argument("--steps", type=int, default=30, help="training steps per run (default 30)")
    parser.add_argument("--rate", default="200mbit", help="the inter-node link (tbf rate, default 200mbit)")
    parser.add_argument("--quick", action="store_true", help="one round of 10 steps (a check, not a result: "
                        "written as hsdp_cluster_quick)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 1, 10
    from cluster import unavailable_reason
    from common import machine_info, markdown_table, write_results

    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"hsdp_cluster: {reason}")
    with tempfile.TemporaryDirectory(prefix="dtrain-hsdp-") as tmp:
        headline, rows = measure(args.rounds, args.steps, args.rate, Path(tmp))
    table = markdown_table(["figure", "value", "per round"],
                           [(key, headline[key], headline[f"{key}_per_round"])
                            for key in ("hsdp_over_fsdp_step_ratio", "hsdp_over_ddp_step_ratio")])
    markdown = (f"# hsdp_cluster\n\nHSDP against FSDP2 and DDP, 2 x 2 emulated cluster, inter-node link tbf "
                f"{args.rate} (benchmarks/hsdp_cluster.py).\n\n{table}\n\nmedian step seconds: "
                f"{headline['step_s_median']}\n")
    path = write_results("hsdp_cluster_quick" if args.quick else "hsdp_cluster", headline, rows, markdown,
                         machine_info(f"2 network namespaces x 2 workers, veth tbf {args.rate}"),
                         {"settings": {"rounds": args.rounds, "steps": args.steps, "rate": args.rate}})
    print(markdown)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
