"""train.hostfile: read into the placement of the update's ranks; every bad file or combination is named
(file and line, both counts, the storage) by preflight, before any work; an agent asked to serve a node the
group does not have says so to rank 0 instead of leaving it waiting."""

import datetime

import pytest
import torch.distributed as dist

from engines.trainer.hostfile import Node, placement_for, read_hostfile
from engines.trainer.rank_agent import _NodeRanks
from flows.preflight_static import hostfile_problem
from ppoflow.config import load_config


def _train(tmp_path, text, *overrides):
    path = tmp_path / "hostfile"
    path.write_text(text)
    return load_config(None, [f"train.hostfile={path}", *overrides])


def test_nodes_in_file_order_and_ranks_numbered_node_by_node(tmp_path):
    cfg = _train(tmp_path, "# two nodes\nnode-a slots=2\n\nnode-b   slots = 2   # the second\n", "train.num_ranks=4")
    placement = placement_for(cfg.train)
    assert placement.nodes == (Node("node-a", 2), Node("node-b", 2))
    assert placement.remote and placement.world == 4
    assert (placement.master_addr, placement.master_port) == ("node-a", 29500)  # the first host by default
    assert [list(placement.ranks_of(n)) for n in (0, 1)] == [[0, 1], [2, 3]]
    assert [placement.node_of(r) for r in range(4)] == [0, 0, 1, 1]


def test_one_line_is_one_node_on_loopback(tmp_path):
    placement = placement_for(_train(tmp_path, "gpu-box slots=2\n", "train.num_ranks=2").train)
    assert not placement.remote and placement.master_addr == "127.0.0.1"


def test_master_address_and_port_from_the_config(tmp_path):
    cfg = _train(
        tmp_path, "a slots=1\nb slots=1\n", "train.num_ranks=2", "train.master_addr=10.0.0.1", "train.master_port=4000"
    )
    placement = placement_for(cfg.train)
    assert (placement.master_addr, placement.master_port) == ("10.0.0.1", 4000)


@pytest.mark.parametrize(
    "text, message",
    [
        ("a slots=1\nb slots\n", r"hostfile:2: 'b slots' is not `<host> slots=<count>`"),
        ("a slots=1\nb slots=0\n", r"hostfile:2: b has slots=0; a node needs at least 1"),
        ("a slots=1\na slots=1\n", r"hostfile:2: a is listed twice"),
        ("# nothing\n\n", r"lists no node"),
    ],
)
def test_bad_hostfiles_are_named_with_file_and_line(tmp_path, text, message):
    path = tmp_path / "hostfile"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_hostfile(str(path))


def test_preflight_names_every_impossible_placement(tmp_path):
    cfg = _train(tmp_path, "a slots=1\nb slots=2\n", "train.num_ranks=2")
    assert hostfile_problem(cfg) == (
        f"train.hostfile {tmp_path / 'hostfile'} places 3 ranks (a: 1, b: 2) but train.num_ranks=2"
    )
    missing = load_config(None, [f"train.hostfile={tmp_path / 'none'}", "train.num_ranks=2"])
    assert "cannot be read" in hostfile_problem(missing) and str(tmp_path / "none") in hostfile_problem(missing)
    s3 = _train(tmp_path, "a slots=1\nb slots=1\n", "train.num_ranks=2", "run.root=s3://bucket/runs")
    assert "run.root='s3://bucket/runs' is not a local folder" in hostfile_problem(s3)
    assert hostfile_problem(_train(tmp_path, "a slots=1\nb slots=1\n", "train.num_ranks=2")) is None
    assert hostfile_problem(load_config(None, [])) is None


def test_an_agent_for_a_node_the_group_lacks_tells_rank_0(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
    spec = {
        "id": "g1",
        "entry": "stages.update_ranks",
        "timeout_s": 5.0,
        "world": 2,
        "master_addr": "127.0.0.1",
        "master_port": store.port,
        "nodes": [{"host": "a", "slots": 1}, {"host": "b", "slots": 1}],
    }
    with pytest.raises(ValueError, match=r"this agent is node 2, but the group published by rank 0 has nodes 0..1"):
        _NodeRanks(spec, 2, store)
    refusal = store.get("group/g1/refused").decode()  # where rank 0's check_alive looks (under the group's prefix)
    assert "node 2" in refusal and "a, b" in refusal
