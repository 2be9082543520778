"""Shard write + read throughput on local disk, against a raw sequential write and read of the same bytes.

    python -m bench.shards [--mb 256] [--repeats 5] [--dir /tmp]

ppoflow: `write_shards` (schema check, split into parts, Arrow IPC serialization, sha256 per part,
temp file + fsync + rename per part, manifest last) and `read_shards` (manifest, read, size and sha256
check, IPC parse, concatenation).
Baseline ("raw"): the very same part bytes, already serialized, written with plain open().write (no
hash, no fsync, no rename) and read back with open().read(). So the ratio is the price of the safety
(hashing, fsync, manifest, schema checks) and of serialization. Goal: ppoflow/raw >= 0.5x.

Rows are realistic scored samples: prompt up to 256 and response up to 1024 token ids, log-probs and
reference log-probs per response token. Best of `repeats` runs for each side, to damp noise from
other processes on a shared machine, the two sides interleaved. Also reported: the read without
hash verification (`verify=False`) and this machine's sha256 speed, because hashing every byte on
write and on read is most of the price: with sha256 at S MiB/s and a page-cache read at R MiB/s, a
verified read cannot beat S*R/(S+R). Ends with one JSON line (bench/common.py emit).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import time

from bench.common import emit
from storage.fs import resolve
from storage.shards import plan_parts, read_shards, serialize_part, write_shards
from storage.synthetic import synthetic_table

PART_BYTES = 64 * 2**20


def build_table(target_mb: int):
    probe = synthetic_table("scored", 2000, seed=0, prompt_len=256, response_len=1024)
    rows = max(1, int(target_mb * 2**20 / (probe.nbytes / probe.num_rows)))
    return synthetic_table("scored", rows, seed=1, prompt_len=256, response_len=1024)


def time_interleaved(steps: dict, repeats: int) -> dict[str, float]:
    """Best time of each step, running the steps in turn within each repeat.

    Interleaving gives both sides the same share of a shared machine's noisy load, which a block of
    ppoflow runs followed by a block of raw runs would not.
    """
    best = {name: float("inf") for name in steps}
    for _ in range(repeats):
        for name, fn in steps.items():
            started = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - started)
    return best


def sha256_mib_s(data: bytes) -> float:
    started = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    return len(data) / 2**20 / (time.perf_counter() - started)


def raw_parts(table) -> list[bytes]:
    """The same parts ppoflow writes, serialized once outside the timed region."""
    plan = plan_parts(table.num_rows, table.nbytes, 4096 * 1024, PART_BYTES)
    return [serialize_part(table.slice(offset, length)).to_pybytes() for offset, length in plan]


def raw_write(folder: str, parts: list[bytes]) -> None:
    os.makedirs(folder, exist_ok=True)
    for i, data in enumerate(parts):
        with open(os.path.join(folder, f"raw-{i:05d}.arrow"), "wb") as f:
            f.write(data)


def raw_read(folder: str, count: int) -> int:
    total = 0
    for i in range(count):
        with open(os.path.join(folder, f"raw-{i:05d}.arrow"), "rb") as f:
            total += len(f.read())
    return total


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="table size in MiB (Arrow in-memory bytes)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per side; the best is kept")
    parser.add_argument("--dir", default=None, help="where to write (default: the system temp folder)")
    args = parser.parse_args(argv)

    table = build_table(args.mb)
    work = tempfile.mkdtemp(prefix="bench-shards-", dir=args.dir)
    try:
        fs, root = resolve(work)
        stage = f"{root}/iter-000001/scored"
        manifest = write_shards(fs, stage, table, "scored", max_rows=4096 * 1024, max_bytes=PART_BYTES)
        parts = raw_parts(table)
        assert [len(p) for p in parts] == [p.bytes for p in manifest.parts], "baseline must write the same bytes"
        mib = manifest.bytes / 2**20

        raw_dir = os.path.join(work, "raw")
        t = time_interleaved(
            {
                "write": lambda: write_shards(fs, stage, table, "scored", max_rows=4096 * 1024, max_bytes=PART_BYTES),
                "raw_write": lambda: raw_write(raw_dir, parts),
                "read": lambda: read_shards(fs, stage),
                "read_unverified": lambda: read_shards(fs, stage, verify=False),
                "raw_read": lambda: raw_read(raw_dir, len(parts)),
            },
            args.repeats,
        )
        hash_speed = max(sha256_mib_s(parts[0]) for _ in range(args.repeats))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    write_s, read_s, raw_write_s, raw_read_s = t["write"], t["read"], t["raw_write"], t["raw_read"]
    ratio = (raw_write_s + raw_read_s) / (write_s + read_s)
    return emit(
        "shards",
        {
            "baseline": "raw open().write/read of the same Arrow IPC bytes",
            "rows": table.num_rows,
            "parts": len(parts),
            "mib": round(mib, 1),
            "ppoflow_write_mib_s": round(mib / write_s, 1),
            "ppoflow_read_mib_s": round(mib / read_s, 1),
            "raw_write_mib_s": round(mib / raw_write_s, 1),
            "raw_read_mib_s": round(mib / raw_read_s, 1),
            "write_ratio": round(raw_write_s / write_s, 3),
            "read_ratio": round(raw_read_s / read_s, 3),
            "read_unverified_ratio": round(raw_read_s / t["read_unverified"], 3),
            "write_read_ratio": round(ratio, 3),
            "goal_ratio": 0.5,
            "goal_met": ratio >= 0.5,
            "sha256_mib_s": round(hash_speed, 1),
            "load_avg_1m": round(os.getloadavg()[0], 2),
        },
    )


if __name__ == "__main__":
    main()
