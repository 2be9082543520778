"""Two real gloo ranks (no DeepSpeed): each holds its own rows of a batch, agree_shape finds the whole batch's widths,
and gather_rows hands both ranks the whole batch (and its forward outputs) exactly as one process builds it;
ranks holding different numbers of rows fail on both ranks alike, naming the counts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]

RANK = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import torch
    import torch.distributed as dist
    from engines.trainer.rank_rows import agree_shape, gather_rows, pad_to
    from tests.unit.test_rank_rows import _batch, _assert_same
    rank, store = int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)

    def outputs(batch):  # stand-ins for a forward's (b, R) outputs: a function of each row's tokens only
        return batch.response_ids.float() * -0.01 * batch.response_mask, batch.response_mask * 2.0

    # rank 0 holds rows 0-1 (prompts 2 wide, responses 4), rank 1 rows 2-3 (prompts 4 wide, responses 2)
    own = _batch([0, 1] if rank == 0 else [2, 3], pad=3)
    shape = agree_shape(own, 2)
    assert shape == (4, 4, 4), shape
    local = pad_to(own, shape.prompt_width, shape.response_width, 3)
    batch, old, values = gather_rows(local, *outputs(local), 2)
    whole = _batch([0, 1, 2, 3], pad=3)  # what one process builds from all four rows
    _assert_same(batch, whole)
    want_old, want_values = outputs(whole)
    assert torch.equal(old, want_old) and torch.equal(values, want_values)
    assert gather_rows(local, want_old[:2], None, 2)[2] is None
    try:
        agree_shape(_batch([0, 1] if rank == 0 else [2, 3, 4], pad=3), 2)
    except ValueError as exc:
        print("ERROR", exc)
    print("GATHERED", rank, flush=True)
    # Leave together and close the group: a process that exits with gloo's threads still up may abort in their
    # destructor ("terminate called without an active exception", seen once on CI as rank 0's exit code -6).
    dist.barrier()
    dist.destroy_process_group()
""")


def test_two_ranks_gather_the_batch_one_process_builds(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    store = tmp_path / "store"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(REPO), str(rank), str(store)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    for rank, (p, (stdout, stderr)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank}:\n{stderr[-3000:]}"
        assert f"GATHERED {rank}" in stdout
        assert "ERROR the update ranks hold [2, 3] rows (rank 0 first): every rank needs the same number" in stdout
