"""Score cache after a long run: segments compacted by level against one segment per put (no compaction).

    python -m bench.score_cache                    # 2,000 puts of 64 entries (a 2,000-iteration run), local disk
    python -m bench.score_cache --puts 500 --entries 64
    python -m bench.score_cache --storage s3 --puts 500   # against moto's S3 server on loopback

Workload: `--puts` puts of `--entries` new entries each, as the score stage writes one segment per
iteration (keys distinct, log-probs of 8 response tokens, two reward components), into a fresh local folder
per variant (`--storage local`: a temp folder; `s3`: a bucket on moto's S3 server, started here on
127.0.0.1 with dummy credentials, where each segment read is a GET and each put a PUT):
- uncompacted (the named baseline): `ScoreCache(compact_at=0)`, the cache as it was before compaction,
  one segment per put for ever;
- compacted: `ScoreCache(compact_at=16)`, the default.
Figures per variant (`--storage local`: a temp folder; `s3`: a bucket on moto's S3 server, started here on
127.0.0.1 with dummy credentials, where each segment read is a GET and each put a PUT): segments left in the
folder; `put_s`, the seconds of all puts (compaction included);
`cold_lookup_s`, a NEW ScoreCache's first `get_many` of one iteration's keys, as a score stage in a fresh
process (a pool worker, a retry after a crash) pays it: list the folder and read every segment (median of
--repeats). Ratio: cold_lookup_speedup = uncompacted / compacted cold_lookup_s; put_cost_ratio = compacted /
uncompacted put_s (what the merges cost the writer). Check (fails the run): both variants' fresh readers
return equal values for every key of the first and the last put.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Iterator

import fsspec

from bench.common import emit
from ppoflow.config import StorageConfig
from storage.fs import list_files, resolve
from storage.score_cache import ScoreCache


def entries_of(put: int, entries: int) -> dict[str, dict]:
    """`entries` distinct keys for one put, values derived from the key (multiples of 1/8: exact in float32)."""
    out = {}
    for i in range(entries):
        key = hashlib.sha256(f"bench/{put}/{i}".encode()).hexdigest()
        seed = int(key[:8], 16)
        out[key] = {
            "reward_components": {"function": float(seed % 2), "length": float(seed % 9)},
            "ref_logprobs": [-((seed >> j) % 64) / 8 for j in range(8)],
        }
    return out


def run_variant(fs, folder: str, compact_at: int, puts: int, entries: int, repeats: int) -> dict:
    writer = ScoreCache(fs, folder, max_bytes=0, compact_at=compact_at)
    start = time.perf_counter()
    for put in range(puts):
        writer.put_many(entries_of(put, entries))
    put_s = time.perf_counter() - start
    last_keys = list(entries_of(puts - 1, entries))
    lookups, values = [], None
    for _ in range(repeats):
        reader = ScoreCache(fs, folder, max_bytes=0, compact_at=0)
        t0 = time.perf_counter()
        found = reader.get_many(last_keys)
        lookups.append(time.perf_counter() - t0)
        values = {**reader.get_many(list(entries_of(0, entries))), **found}
    segments = len(list_files(fs, folder))
    fs.rm(folder, recursive=True)
    return {
        "segments": segments,
        "put_s": round(put_s, 3),
        "cold_lookup_s": round(statistics.median(lookups), 4),
        "_values": values,
    }


@contextlib.contextmanager
def storage(kind: str) -> Iterator[tuple[Any, str]]:
    """(filesystem, base folder): a temp folder, or a fresh bucket on a moto S3 server on loopback."""
    if kind == "local":
        base = tempfile.mkdtemp(prefix="ppoflow-bench-score-cache-")
        try:
            yield fsspec.filesystem("file"), base
        finally:
            shutil.rmtree(base, ignore_errors=True)
        return
    from moto.server import ThreadedMotoServer

    for key, value in {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        os.environ.setdefault(key, value)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        fs, root = resolve("s3://ppoflow-bench/cache", StorageConfig(endpoint_url=f"http://{host}:{port}"))
        fs.mkdir("ppoflow-bench")
        yield fs, root
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--puts", type=int, default=2000)
    p.add_argument("--entries", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--storage", choices=["local", "s3"], default="local")
    a = p.parse_args(argv)
    with storage(a.storage) as (fs, base):
        results = {
            name: run_variant(fs, f"{base}/{name}", compact_at, a.puts, a.entries, a.repeats)
            for name, compact_at in (("uncompacted", 0), ("compacted", 16))
        }
    if results["uncompacted"].pop("_values") != results["compacted"].pop("_values"):
        raise SystemExit("compacted and uncompacted caches return different values")
    base, ours = results["uncompacted"], results["compacted"]
    return emit(
        "score_cache",
        {
            "puts": a.puts,
            "entries_per_put": a.entries,
            "storage": a.storage,
            "baseline": "uncompacted (compact_at=0)",
            "variants": results,
            "cold_lookup_speedup": round(base["cold_lookup_s"] / ours["cold_lookup_s"], 2),
            "put_cost_ratio": round(ours["put_s"] / base["put_s"], 3),
        },
    )


if __name__ == "__main__":
    main()
