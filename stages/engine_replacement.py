"""Engines that are replaced: a rollout or eval stage whose engine's process dies under it builds the engine again and
samples again, within the stage.

    sample, engine, attested, replaced = with_live_engine(rollout_engine_for, cfg, policy, "rollout", iteration, sample)

`sample(engine)` is the stage's sampling (one call of the engine's generate or a dynamic-sampling loop of them); on
EngineDied (engines/rollout/base.py: vLLM's EngineCore killed, out of memory, a segfault) the dead engine is dropped
from the registry, a new one is built for the same policy and attested like the first, and `sample` runs again from
the start. Every request is seeded (engines/rollout/base.prompt_sampling_seed), so the rows are the ones an
uninterrupted stage writes, row for row. After `rollout.engine_replacements` replacements, one more death fails the
stage with EngineLost naming the stage, the iteration, the engine and the setting.

Why the whole stage's requests and not only the unfinished ones: vLLM returns a generate's outputs together, so a
death leaves none finished that the stage could keep; and seeded, the finished ones would come out the same again.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, TypeVar

from engines.rollout.base import EngineDied, RolloutEngine
from engines.rollout.registry import discard
from stages.attest import attest
from stages.manifests import Attestation, PolicyRef

log = logging.getLogger("ppoflow.rollout")
T = TypeVar("T")


class EngineLost(RuntimeError):
    """A stage's engine died more often than rollout.engine_replacements allows."""


def with_live_engine(
    engine_for: Callable[..., RolloutEngine],
    cfg,
    policy: PolicyRef,
    stage: str,
    iteration: int,
    sample: Callable[[RolloutEngine], T],
) -> tuple[T, RolloutEngine, Optional[Attestation], int]:
    """(sample(engine)'s result, the engine that produced it, its attestation, how many engines were replaced).

    engine_for(cfg, policy): the stage's engine for `policy` (stages.rollout.rollout_engine_for).
    Raises EngineLost past cfg.rollout.engine_replacements; AttestationError, and sample's own errors, unchanged."""
    replaced = 0
    while True:
        engine = engine_for(cfg, policy)
        attested = attest(engine, cfg, policy, stage, iteration)
        try:
            return sample(engine), engine, attested, replaced
        except EngineDied as died:
            discard(engine)
            if replaced >= cfg.rollout.engine_replacements:
                raise EngineLost(
                    f"{stage} stage of iteration {iteration}: the {engine.name} engine died ({died}) after "
                    f"{replaced} replacement(s); rollout.engine_replacements={cfg.rollout.engine_replacements} "
                    f"allows no more"
                ) from died
            replaced += 1
            log.warning("%s iteration %d: the %s engine died (%s); building replacement %d of %d and sampling again",
                        stage, iteration, engine.name, died, replaced, cfg.rollout.engine_replacements)  # fmt: skip
