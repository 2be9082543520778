"""Data-parallel rollout (pipeline.rollout_parts = N > 1): the iteration's prompts in N parts, then one merge.

    split_prompts(records, part, parts) -> records              part `part`: a contiguous slice of the prompts
    run_rollout_part(cfg, iteration, policy, part, parts)       sample one part -> RolloutPartManifest
    merge_rollout_parts(cfg, iteration, part manifests)         all parts' rows -> the iteration's RolloutManifest

Each part is a stage task run of its own (tasks/stage_tasks.py): cached and retried alone, so a worker that dies
loses only its part, and several warm rollout workers sample an iteration's parts side by side. The merge is
cheap (no engine: it reads the parts' shards and writes the iteration's rollout shards), so the score stage
and everything after it see one RolloutManifest, exactly as with one part.

Why the merged rows equal the unsplit ones, row for row: the parts are contiguous slices of the iteration's
prompt list, concatenated in part order, and each prompt is sampled with its own seed (stages/rollout.py),
so which other prompts share an engine call is moot. Except in the last bits of `rollout_logprobs`: the HF
sampler left-pads a batch to its longest prompt, and fp32 sums over a row padded otherwise round otherwise
(seen: 4.8e-7; the tokens, and the weights trained at max_staleness 0 without TIS, are bitwise equal).

Storage: part p of N writes `<run>/iter-NNNNNN/rollout-parts/part-0000p-of-0000N/` (shards + manifest, the
same format as any stage folder); the merge writes `<run>/iter-NNNNNN/rollout/` as the unsplit stage would. The
part folders stay: they are the parts' cached outputs, read again by a retried merge.
"""

from __future__ import annotations

import time

import pyarrow as pa

from engines import warm
from stages.curriculum_state import iteration_level, tag_level
from stages.engine_replacement import with_live_engine
from stages.handed import read_handed
from stages.held import prompt_source_for
from stages.manifests import PolicyRef, RolloutManifest, RolloutPartManifest
from stages.rollout import rollout_engine_for, sample_records, sampled_manifest
from stages.tables import write_stage_table
from storage.fs import join
from storage.layout import RunLayout, layout_for


def split_prompts(records: list, part: int, parts: int) -> list:
    """Part `part` (0-based) of `parts` contiguous slices of `records` whose sizes differ by at most one (the first
    len(records) % parts parts take one more). ValueError unless 0 <= part < parts <= len(records)."""
    if not 0 <= part < parts <= len(records):
        raise ValueError(f"rollout part {part} of {parts}: needs 0 <= part < parts <= {len(records)} prompts")
    base, extra = divmod(len(records), parts)
    start = part * base + min(part, extra)
    return records[start : start + base + (1 if part < extra else 0)]


def part_dir(layout: RunLayout, iteration: int, part: int, parts: int) -> str:
    """The shards folder of rollout part `part` of `parts` in iteration `iteration`."""
    return join(layout.iteration_dir(iteration), "rollout-parts", f"part-{part:05d}-of-{parts:05d}")


def run_rollout_part(cfg, iteration: int, policy: PolicyRef, part: int, parts: int) -> RolloutPartManifest:
    """Sample part `part` of `parts` of iteration `iteration`'s prompts with `policy` into the part's own folder
    (replacing what it held, manifest last). Errors: ValueError for a part outside 0..parts-1 or more parts than
    prompts; the engine's errors name the prompt."""
    started = time.perf_counter()
    level = iteration_level(cfg, policy)  # data.reasoning_gym.curriculum (stages/curriculum_state.py)
    source = prompt_source_for(cfg, level)
    every = source.prompts_for_iteration(iteration, cfg.rollout.prompts_per_iteration, cfg.run.seed)
    records = split_prompts(every, part, parts)
    with warm.stage_lock("rollout"):  # pipelined iterations (or parts in threads): one engine, one call at a time
        sample = lambda engine: sample_records(engine, source, cfg, iteration, records)  # noqa: E731
        stage = f"rollout part {part} of {parts}"
        table, engine, attested, _ = with_live_engine(rollout_engine_for, cfg, policy, stage, iteration, sample)
        table = tag_level(table, level)
    layout = layout_for(cfg)
    folder = part_dir(layout, iteration, part, parts)
    written = write_stage_table(cfg, layout, iteration, "rollout", table, folder=folder)
    fields = {"part": part, "parts": parts, "prompts": len(records), "attested": attested}
    return sampled_manifest(
        RolloutPartManifest, written, iteration, started, policy_version=policy.version, engine=engine.name, **fields
    )


def _check_parts(iteration: int, parts: list[RolloutPartManifest]) -> None:
    """ValueError naming the first part that is not part i of len(parts) of this iteration, of one policy."""
    if not parts:
        raise ValueError(f"rollout merge of iteration {iteration}: no parts")
    for i, p in enumerate(parts):
        if (p.part, p.parts, p.iteration) != (i, len(parts), iteration):
            raise ValueError(
                f"rollout merge of iteration {iteration}: manifest {i} is part {p.part} of {p.parts} of iteration "
                f"{p.iteration}; expected part {i} of {len(parts)} of iteration {iteration}, in part order"
            )
        if p.policy_version != parts[0].policy_version:
            raise ValueError(
                f"rollout merge of iteration {iteration}: part {i} was sampled by policy version {p.policy_version}, "
                f"part 0 by {parts[0].policy_version}"
            )


def merge_rollout_parts(cfg, iteration: int, parts: list[RolloutPartManifest]) -> RolloutManifest:
    """Write the parts' rows, in part order, as iteration `iteration`'s rollout shards (manifest last).

    Each part is read at its manifest's uri (stages/handed.py). Errors: ValueError when `parts` is not parts 0..N-1
    of this iteration sampled by one policy; HandedShardsError when a part's folder is gone or holds other shards
    than its manifest names (rewritten since); ShardCorruptError naming a part file."""
    started = time.perf_counter()
    _check_parts(iteration, parts)
    layout = layout_for(cfg)
    here = {p.part: layout.url(part_dir(layout, iteration, p.part, p.parts)) for p in parts}  # a moved run
    tables = [read_handed(cfg.storage, p, "rollout merge", iteration, moved_to=here[p.part]) for p in parts]
    written = write_stage_table(cfg, layout, iteration, "rollout", pa.concat_tables(tables))
    return sampled_manifest(
        RolloutManifest,
        written,
        iteration,
        started,
        policy_version=parts[0].policy_version,
        engine=parts[0].engine,
        attested=parts[0].attested,  # every part's engine attested the one policy version _check_parts allows
        part_workers=[p.worker for p in parts],
    )
