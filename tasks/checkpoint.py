"""The checkpoint stage: commit the staged checkpoint (marker last), move LATEST, apply retention."""
from __future__ import annotations

import time
from typing import Any

from prefect import task

from engines import warm
from ppoflow.config import PPOFlowConfig
from storage.checkpoints import commit_checkpoint
from tasks.common import STAGE_BODY_CALLS, as_config, cache_key_fn, layout_for
from tasks.policy import policy_ref
from tasks.update import TRAINER_ROLE


def run_checkpoint(config: PPOFlowConfig | dict, iteration: int, update: dict[str, Any]) -> dict[str, Any]:
    """Commit iteration `iteration`'s staged checkpoint -> checkpoint manifest. Idempotent."""
    cfg = as_config(config)
    STAGE_BODY_CALLS["checkpoint"] += 1
    started = time.perf_counter()
    layout = layout_for(cfg)
    commit_checkpoint(layout, iteration, {"iteration": iteration, "metrics": update.get("metrics", {}),
                                          "files_hash": update["content_hash"]},
                      keep_last=cfg.run.keep_checkpoints)
    next_policy = policy_ref(cfg, iteration + 1)
    # The warm trainer now holds exactly the committed state: tag it so iteration+1 reuses it.
    held = warm.peek(TRAINER_ROLE)
    if held is not None and held[0] == f"staged-{cfg.run.name}-{iteration}":
        warm.retag(TRAINER_ROLE, next_policy["content_hash"])
    return {"stage": "checkpoint", "iteration": iteration, "uri": update["checkpoint_uri"],
            "content_hash": next_policy["content_hash"], "seconds": time.perf_counter() - started}


checkpoint_task = task(run_checkpoint, name="checkpoint", task_run_name="checkpoint-iter-{iteration}",
                       cache_key_fn=cache_key_fn("checkpoint"), persist_result=True, result_serializer="json")
