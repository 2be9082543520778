"""The digits rule's reward of every iteration of a run, measured on its rollout shards (not by the run's reward).

For a PPO run whose reward is a learned reward model, this is the check that the policy learned the task
and not only the model's taste: each rollout row's `response` text scored by engines/toy/task.digit_reward
against its `label`, averaged per iteration.

    python -m engines.toy.rule_report ./runs/demo-rm
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from engines.toy.task import digit_reward


def rule_reward_by_iteration(run_dir: str | Path) -> dict[int, float]:
    """{iteration: mean digits-rule reward of its rollout rows} for every iteration folder with rollout shards.

    Raises FileNotFoundError naming the run folder when it has no iteration with rollout shards.
    """
    import pyarrow.dataset as ds

    from storage.layout import parse_iteration_name

    found: dict[int, float] = {}
    for folder in sorted(Path(run_dir).glob("iter-*/rollout")):
        iteration = parse_iteration_name(folder.parent.name)
        if iteration is None or not any(folder.glob("part-*.arrow")):
            continue
        table = (
            ds.dataset(sorted(str(p) for p in folder.glob("part-*.arrow")), format="arrow")
            .to_table(columns=["response", "label"])
            .to_pydict()
        )
        rewards = [digit_reward(r, label) for r, label in zip(table["response"], table["label"])]
        found[iteration] = sum(rewards) / len(rewards)
    if not found:
        raise FileNotFoundError(f"{run_dir} has no iter-*/rollout/part-*.arrow shards")
    return found


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    by_iteration = rule_reward_by_iteration(p.parse_args(argv).run_dir)
    for iteration, value in by_iteration.items():
        print(json.dumps({"iteration": iteration, "rule_reward": round(value, 4)}))


if __name__ == "__main__":
    main()
