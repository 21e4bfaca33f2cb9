"""The membership record (runs/membership.py): which entry an attempt adds, its reason and its seconds; `--nnodes
MIN:MAX` parsed and checked; the elastic rendezvous numbers the nodes present."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch.distributed import HashStore

from dtrain.errors import LaunchError
from dtrain.launch import NodeSpec, parse_nnodes
from dtrain.runs.membership import (
    TRAINING,
    append_membership,
    describe_change,
    membership_change,
    read_membership,
    read_restarts,
    record_restart,
)

A, B = "10.0.0.1:100", "10.0.0.2:200"


def _start() -> dict[str, Any]:
    entry = membership_change([], [], step=0, world_size=2, nodes=[A, B], now=1000.0)
    assert entry is not None
    return entry


def test_the_first_attempt_is_the_start() -> None:
    assert _start() == {"step": 0, "world_size": 2, "nodes": [A, B], "reason": "start", "lost": [], "joined": [],
                        "seconds": None, "at": 1000.0}


def test_a_restart_at_the_same_membership_adds_nothing() -> None:
    restarts = [{"cause": "failure", "at": 1010.0}]
    assert membership_change([_start()], restarts, step=30, world_size=2, nodes=[B, A], now=1020.0) is None


def test_a_lost_node_counts_from_the_first_restart_since_the_last_training() -> None:
    restarts = [{"cause": TRAINING, "at": 1000.0}, {"cause": "failure", "at": 1005.0},  # a crash, same nodes
                {"cause": TRAINING, "at": 1012.0}, {"cause": "failure", "at": 1050.0},  # the loss
                {"cause": "failure", "at": 1061.0}]  # a second try of the rendezvous
    entry = membership_change([_start()], restarts, step=40, world_size=1, nodes=[A], now=1070.5)
    assert entry is not None
    assert (entry["reason"], entry["lost"], entry["joined"], entry["seconds"]) == ("node lost", [B], [], 20.5)


def test_a_joined_node_and_a_swap() -> None:
    alone = membership_change([], [], step=0, world_size=1, nodes=[A], now=1000.0)
    assert alone is not None
    grown = membership_change([alone], [{"cause": "nodes_waiting", "at": 1100.0}], step=50, world_size=2,
                              nodes=[A, B], now=1112.0)
    assert grown is not None and (grown["reason"], grown["joined"], grown["seconds"]) == ("node joined", [B], 12.0)
    swapped = membership_change([alone], [{"cause": "failure", "at": 1100.0}], step=50, world_size=1,
                                nodes=[B], now=1103.0)
    assert swapped is not None and (swapped["reason"], swapped["lost"], swapped["joined"]) == ("nodes changed", [A],
                                                                                               [B])


def test_a_new_launch_at_another_size_is_a_resume_without_seconds() -> None:
    entry = membership_change([_start()], [{"cause": TRAINING, "at": 1000.0}], step=60, world_size=1, nodes=[A],
                              now=5000.0)
    assert entry is not None and (entry["reason"], entry["seconds"]) == ("resumed", None)


def test_the_files_round_trip_and_a_cut_line_is_skipped(tmp_path: Path) -> None:
    record_restart(tmp_path, "failure", 5.0)
    with (tmp_path / "logs" / "restarts.jsonl").open("a") as out:
        out.write('{"cause": "fail')  # the launcher killed while writing
    assert read_restarts(tmp_path) == [{"cause": "failure", "at": 5.0}]
    assert read_membership(tmp_path) == []
    append_membership(tmp_path, _start())
    append_membership(tmp_path, {**_start(), "step": 9})
    assert [e["step"] for e in read_membership(tmp_path)] == [0, 9]


def test_the_progress_line() -> None:
    restarts = [{"cause": "failure", "at": 1050.0}]
    entry = membership_change([_start()], restarts, step=40, world_size=1, nodes=[A], now=1062.34)
    assert entry is not None
    assert describe_change(entry) == (f"membership: node lost (-{B}); 1 node(s), 1 worker(s) from batch 40, training "
                                      "again 12.3 s after the agents restarted")


@pytest.mark.parametrize(("text", "parsed"), [("2", (2, None)), ("1:2", (2, 1)), (" 2:2 ", (2, 2))])
def test_nnodes_parses(text: str, parsed: tuple[int, int | None]) -> None:
    assert parse_nnodes(text) == parsed


@pytest.mark.parametrize(("text", "message"), [
    ("3:2", "--nnodes 3:2: MIN (3) must not exceed MAX (2): the job runs on MIN to MAX nodes; write --nnodes 2:3"),
    ("0:2", "--nnodes 0:2: MIN must be >= 1 (a job needs a node); write --nnodes 1:2"),
    ("0", "--nnodes 0 must be >= 1"),
    ("1:", "--nnodes '1:': give a number of nodes N or a range MIN:MAX"),
    ("a:b", "--nnodes 'a:b': give a number of nodes N or a range MIN:MAX"),
])
def test_bad_nnodes_is_one_line(text: str, message: str) -> None:
    with pytest.raises(LaunchError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        parse_nnodes(text)


def test_an_elastic_range_checks_slots_strategy_and_stages() -> None:
    from dtrain.config import load_config
    from dtrain.launch import check_elastic_range

    node = NodeSpec(nnodes=2, min_nodes=1, node_rank=1, master_port=29999)
    assert node.elastic and node.nnodes_text == "1:2"
    node.validate(4)
    with pytest.raises(LaunchError, match=r"slots_per_trial \(3\) must be a multiple of MAX in --nnodes 1:2"):
        node.validate(3)
    assert not NodeSpec(nnodes=2, min_nodes=2, master_port=29999).elastic
    raw = {"name": "x", "entrypoint": "m:T", "hyperparameters": {"global_batch_size": 8},
           "resources": {"slots_per_trial": 4}, "searcher": {"name": "single", "metric": "loss",
                                                              "max_length": {"batches": 4}}}
    check_elastic_range(load_config(None, raw=raw).config, node)
    local = {**raw, "distributed": {"strategy": "local_sgd"}}
    with pytest.raises(LaunchError, match="^--nnodes 1:2: strategy local_sgd cannot change size while it runs"):
        check_elastic_range(load_config(None, raw=local).config, node)
    piped = {**raw, "distributed": {"strategy": "pipeline", "pipeline": {"stages": 4}}}
    with pytest.raises(LaunchError, match="at 1 node.* the 2 workers cannot hold the pipeline's 4 stages"):
        check_elastic_range(load_config(None, raw=piped).config, node)
    for fits in ({"strategy": "hierarchical"}, {"strategy": "hsdp"}, {"strategy": "hsdp", "hsdp": {"shard_size": 2}}):
        check_elastic_range(load_config(None, raw={**raw, "distributed": fits}).config, node)
    wide = {**raw, "distributed": {"strategy": "hsdp", "hsdp": {"shard_size": 4}}}
    with pytest.raises(LaunchError, match=r"^--nnodes 1:2: at 1 node\(s\) the job runs 2 workers, and "
                                          r"distributed.hsdp.shard_size \(4\) must divide"):
        check_elastic_range(load_config(None, raw=wide).config, node)


class _Inner:
    """torch's handler, reduced to a round of `world` nodes in which this node got round rank `rank`."""

    def __init__(self, store: Any, rank: int, world: int) -> None:
        self.store, self.rank, self.world = store, rank, world

    def next_rendezvous(self) -> Any:
        from torch.distributed.elastic.rendezvous import RendezvousInfo
        from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

        return RendezvousInfo(self.store, self.rank, self.world, RendezvousStoreInfo("127.0.0.1", 1))  # type: ignore[arg-type]


@pytest.mark.parametrize(("elastic", "given", "mine", "expected"), [
    (True, {0: 0, 1: 2}, 2, 1),  # node 1 of 0, 1, 2 is gone: node 2 is the second node now
    (False, {0: 0, 1: 1}, 1, 1),
])
def test_the_rendezvous_numbers_the_nodes_present(elastic: bool, given: dict[int, int], mine: int, expected: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from dtrain.comm import rendezvous

    monkeypatch.setattr(rendezvous.RendezvousStoreInfo, "build", lambda *args, **kwargs: None)
    store = HashStore()
    for round_rank, node_rank in given.items():
        store.set(f"dtrain/node_rank/{round_rank}", str(node_rank))
    round_rank = next(r for r, n in given.items() if n == mine)
    handler = rendezvous.NodeRankRendezvous(_Inner(store, round_rank, len(given)), mine, "127.0.0.1",  # type: ignore[arg-type]
                                            elastic=elastic)
    assert handler.next_rendezvous().rank == expected


def test_the_elastic_rendezvous_needs_the_chief(monkeypatch: pytest.MonkeyPatch) -> None:
    from dtrain.comm import rendezvous

    monkeypatch.setattr(rendezvous.RendezvousStoreInfo, "build", lambda *args, **kwargs: None)
    store = HashStore()
    store.set("dtrain/node_rank/0", "1")
    handler = rendezvous.NodeRankRendezvous(_Inner(store, 0, 1), 1, None, elastic=True)  # type: ignore[arg-type]
    with pytest.raises(LaunchError, match="the chief .* must be one"):
        handler.next_rendezvous()
