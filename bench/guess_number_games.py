"""What a guess-the-number run's policy does with the feedback, read from its shards (issue 39 item 6).

    python -m bench.guess_number_games ./runs/multi-turn-guess-number-information
    python -m bench.guess_number_games RUN_DIR --results-dir /tmp/x      # the line elsewhere (a smoke run)

Per iteration, from the games the rollout played before its update (iter-*/rollout) and, where the run evaluated,
from the eval games (iter-*/eval: row 0 is the initial policy): games, games won (the environment's is_success),
the mean game reward, what counting up 1, 2, 3, 4 would win on the same secrets (the policy deaf to the feedback),
replies holding a guess, after "Higher." the share of next guesses above the last one and after "Lower." below
it (how many such turns), the share of guesses consistent with all the feedback so far (a number still possible),
the first guesses, and the games won per secret (counting up never wins one above 4). Binary search opens with
5 (or 6) and always wins within 4 guesses; counting up wins 4 secrets in 10. Reads each game's env_info (the guess
of every turn, engines/environments/guess_number.py) and label (the secret); the feedback is derived from them:
"Higher." when the guess is below the secret.

Ends with one JSON line (bench/common.py emit) holding every row, appended to bench/results/guess_number_games.jsonl.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Optional

import pyarrow.dataset as ds

from bench.common import emit

COUNT_UP_TURNS = 4  # the game's guesses: counting up from 1 finds the secrets 1..4


def game_stats(games: list[dict]) -> dict:
    """Figures of a list of games, each {"label": secret as text, "env_info": JSON list of {"guess", "is_success"}}.
    A reply without a number has guess None: it counts as a turn, never as heeding or consistent."""
    won = heard_higher = heeded_higher = heard_lower = heeded_lower = guesses = consistent = 0
    first, played_secret, won_secret = Counter(), Counter(), Counter()
    count_up = 0
    for game in games:
        secret, steps = int(game["label"]), json.loads(game["env_info"])
        win = bool(steps and steps[-1].get("is_success"))
        won += win
        played_secret[secret] += 1
        won_secret[secret] += win
        count_up += secret <= COUNT_UP_TURNS
        first[str(steps[0]["guess"]) if steps else "None"] += 1
        low, high, last = 1, 10, None  # the numbers still possible given the feedback so far
        for step in steps:
            guess = step.get("guess")
            if guess is not None:
                guesses += 1
                consistent += low <= guess <= high
            if last is not None and guess is not None:
                if last < secret:
                    heard_higher, heeded_higher = heard_higher + 1, heeded_higher + (guess > last)
                elif last > secret:
                    heard_lower, heeded_lower = heard_lower + 1, heeded_lower + (guess < last)
            if guess is not None:
                low, high = (max(low, guess + 1), high) if guess < secret else (low, min(high, guess - 1))
                last = guess
    turns = sum(len(json.loads(g["env_info"])) for g in games)
    n = len(games)
    return {
        "games": n,
        "win_rate": round(won / n, 4) if n else None,
        "count_up_win_rate": round(count_up / n, 4) if n else None,
        "replies_with_a_number": round(guesses / turns, 4) if turns else None,
        "higher_heeded": round(heeded_higher / heard_higher, 4) if heard_higher else None,
        "after_higher": heard_higher,
        "lower_heeded": round(heeded_lower / heard_lower, 4) if heard_lower else None,
        "after_lower": heard_lower,
        "consistent_guesses": round(consistent / guesses, 4) if guesses else None,
        "first_guesses": dict(first.most_common(4)),
        # "won/played" per secret: counting up never wins a secret above 4, whatever it plays
        "wins_by_secret": {str(k): f"{won_secret[k]}/{played_secret[k]}" for k in sorted(played_secret)},
        "wins_above_4": sum(v for k, v in won_secret.items() if k > COUNT_UP_TURNS),
    }


def _games(folder: Path) -> Optional[list[dict]]:
    if not (folder / "_manifest.json").is_file():
        return None
    table = ds.dataset(str(folder), format="arrow").to_table(columns=["label", "env_info", "env_reward"])
    return table.to_pylist()


def run_rows(run_dir: Path) -> list[dict]:
    """One row per iteration folder with games: its training games ("rollout") and eval games ("eval")."""
    rows = []
    for folder in sorted(run_dir.glob("iter-*")):
        row: dict = {"iteration": int(folder.name.split("-")[1])}
        for stage in ("rollout", "eval"):
            games = _games(folder / stage)
            if games:
                stats = game_stats(games)
                stats["reward_mean"] = round(sum(g["env_reward"] for g in games) / len(games), 4)
                row[stage] = stats
        if len(row) > 1:
            rows.append(row)
    return rows


def main(argv: Optional[list[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="the run's folder (run.root/run.name), local")
    p.add_argument("--results-dir", default=None, help="where the line is appended (default bench/results)")
    a = p.parse_args(argv)
    run_dir = Path(a.run_dir)
    if not (run_dir / "run.json").is_file():
        raise SystemExit(f"{run_dir}: no run.json, not a run folder")
    rows = run_rows(run_dir)
    if not rows:
        raise SystemExit(f"{run_dir}: no committed rollout or eval shards under iter-*/")
    return emit("guess_number_games", {"run": run_dir.name, "rows": rows}, a.results_dir)


if __name__ == "__main__":
    main()
