"""Entry points behind `ppoflow train` and `ppoflow demo`: run the training flow and show its progress.

What the terminal shows (everything else goes to the run's log file, flows/logs.py): one line per
iteration as the iteration commits (a table: header once, then rows), a progress bar with the elapsed
time and an ETA, and at the end where the shards, checkpoints, metrics, TensorBoard events and log are.
"""

from __future__ import annotations

import logging
import os
import shlex
import threading
from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from ppoflow.config import PPOFlowConfig, load_config

DEMO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"
# (metrics key, header, width, format): the per-iteration table.
_COLUMNS = [
    ("iteration", "iter", 5, "{}"),
    ("reward/mean", "reward", 8, "{:.3f}"),
    ("signal/group_spread", "signal", 6, "{:.2f}"),  # share of groups whose rewards differ (flows/signal_advice.py)
    ("kl/mean", "kl", 9, "{:.4f}"),
    ("timing/rollout", "rollout s", 10, "{:.1f}"),
    ("timing/score", "score s", 8, "{:.1f}"),
    ("timing/update", "update s", 9, "{:.1f}"),
    ("timing/checkpoint", "ckpt s", 7, "{:.1f}"),
    ("eval/reward_mean", "eval", 6, "{:.3f}"),  # "-" in iterations without an eval (eval.every)
    ("eval/accuracy", "acc", 5, "{:.2f}"),  # rewards in [0, 1]: the share scored 1.0
    ("timing/eval", "eval s", 7, "{:.1f}"),
    ("timing/iteration", "iter s", 7, "{:.1f}"),
]


def _fmt(row: dict[str, Any], key: str, fmt: str) -> str:
    value = row.get(key)
    return "-" if value is None else fmt.format(value)


def table_header() -> str:
    return " ".join(label.rjust(width) for _, label, width, _ in _COLUMNS)


def table_row(row: dict[str, Any]) -> str:
    return " ".join(_fmt(row, key, fmt).rjust(width) for key, _, width, fmt in _COLUMNS)


def promotion_line(row: dict[str, Any]) -> Optional[str]:
    """The line saying that iteration's update moved the curriculum up a level (data.reasoning_gym.curriculum), or
    None when the row shows no move."""
    level, after = row.get("curriculum/level"), row.get("curriculum/next_level")
    if level is None or after is None or after <= level:
        return None
    reward = row.get("curriculum/reward_at_level")
    measured = "" if reward is None else f" (reward at level {int(level)}: {reward:.3f})"
    return f"curriculum: level {int(level)} -> {int(after)} from iteration {int(row['iteration']) + 1}{measured}"


class IterationTable:
    """Prints the iteration rows of metrics.jsonl that it has not printed yet, header first.

    Polled from a watcher thread while the flow runs and once more after it returns, so the last
    iteration's row and the bar's last step are shown (the watcher alone stopped one short: N-1/N).
    """

    def __init__(self, cfg: PPOFlowConfig, progress: Progress, task_id, already: int):
        from storage.layout import layout_for

        self.layout = layout_for(cfg)
        self.progress, self.task_id = progress, task_id
        self.printed_iterations: set[int] = set()
        self.header_printed = False
        self.committed = already
        self.cfg, self.advised = cfg, False
        self._lock = threading.Lock()

    def poll(self) -> None:
        from flows.records import read_metrics

        try:
            rows = read_metrics(self.layout)
        except Exception:  # noqa: BLE001 - rewritten whole on S3/retries; a read may race a write
            return
        with self._lock:
            for row in rows:
                iteration = int(row["iteration"])
                # Row 0 (eval.before_training) is printed by the start that ran it; it is no iteration of the bar.
                earlier_start = iteration <= self.committed and (iteration > 0 or self.committed > 0)
                if iteration in self.printed_iterations or earlier_start:
                    continue
                if not self.header_printed:
                    self.progress.console.print(table_header(), style="bold", highlight=False)
                    self.header_printed = True
                self.printed_iterations.add(iteration)
                self.progress.console.print(table_row(row), highlight=False)
                if (promotion := promotion_line(row)) is not None:
                    self.progress.console.print(promotion, highlight=False)
            done = self.committed + len(self.printed_iterations - {0})
            self.progress.update(self.task_id, completed=done)
            self._advise(rows)

    def _advise(self, rows: list) -> None:
        """Print flows/signal_advice.py's line once, when the groups have carried too little signal (and log it)."""
        from flows.signal_advice import signal_advice

        advice = None if self.advised else signal_advice(rows, self.cfg)
        if advice is not None:
            self.advised = True
            self.progress.console.print(advice, style="yellow", highlight=False, markup=False)
            logging.getLogger("ppoflow.signal").warning(advice)


def progress_bar(console: Console) -> Progress:
    """The bar: description, bar, N/M, elapsed, ETA. Rows printed with `progress.console.print` go above it."""
    # No redirects: on a terminal rich would swap sys.stdout/sys.stderr for proxies that print above the
    # bar, bringing back every library line that flows/logs.py sends to the log file.
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("elapsed"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
        redirect_stdout=False,
        redirect_stderr=False,
    )


def _watch(table: IterationTable, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        table.poll()


def train(cfg: PPOFlowConfig, console: Optional[Console] = None) -> dict[str, Any]:
    """Run the training flow for `cfg` with a progress bar and the iteration table on `console`.

    The flow run is a run of the `ppoflow-train` deployment (flows/deployment.py), so it can be retried from
    the UI and with `prefect flow-run retry ID`. ConfigError before anything else when PREFECT_API_URL names a
    server that does not answer (runtime/prefect_api.py)."""
    from engines.reasoning_tasks import materialize
    from flows.deployment import train_through_deployment
    from flows.run_root import absolute_root
    from runtime.prefect_api import check_prefect_api, temporary_server_starting
    from stages.rollout import build_initial_engine
    from storage.checkpoints import latest_iteration
    from storage.layout import layout_for

    check_prefect_api()
    console = console or Console()
    # run.root absolute (flows/run_root.py), as the flow records it; data.reasoning_gym: write its files here,
    # so the paths printed below are its
    cfg = materialize(absolute_root(cfg))
    layout = layout_for(cfg)
    already = min(latest_iteration(layout) or 0, cfg.run.iterations) if layout.fs.exists(layout.run_dir) else 0
    if already:
        console.print(
            f"run {cfg.run.name}: resuming after iteration {already} (LATEST) at {layout.url(layout.run_dir)}",
            highlight=False,
        )
    if not already and _builds_rollout_here(cfg):
        with temporary_server_starting():  # the server's start (~9 s) and the engine's build (~15 s) overlap
            build_initial_engine(cfg)
    stop = threading.Event()
    with progress_bar(console) as progress:
        task_id = progress.add_task(f"run {cfg.run.name}", total=cfg.run.iterations, completed=already)
        table = IterationTable(cfg, progress, task_id, already)
        watcher = threading.Thread(target=_watch, args=(table, stop), daemon=True, name="ppoflow-progress")
        watcher.start()
        try:
            result = train_through_deployment(cfg.model_dump(mode="json"))
        finally:
            stop.set()
            watcher.join()
            table.poll()
    _print_where(cfg, console)
    return result


def _builds_rollout_here(cfg: PPOFlowConfig) -> bool:
    """Whether iteration 1's rollout runs in this process, on this (the flow's) thread, on inputs that pass the
    static checks. The thread: with pipeline.max_staleness >= 1 the stages run on the task runner's threads, and an
    engine built here would give this thread an OpenMP team of its own besides theirs (slow: runtime/workers.py).
    The checks: a run its preflight refuses should not wait for an engine build to end before it exits."""
    from flows.preflight_static import static_problems
    from runtime.placement import placement

    if cfg.pipeline.max_staleness or placement(cfg, "rollout", 1) != "process":
        return False
    return not static_problems(cfg)


def _print_where(cfg: PPOFlowConfig, console: Console) -> None:
    from flows.tracker import tensorboard_dir_for
    from storage.layout import layout_for

    layout = layout_for(cfg)
    last = cfg.run.iterations
    kinds = "rollout,scored,experience" + (",eval" if cfg.eval.data_path else "")
    console.print(f"shards:      {layout.url(layout.run_dir)}/iter-*/{{{kinds}}}/", highlight=False)
    console.print(f"checkpoints: {layout.url(layout.checkpoints_dir)}/", highlight=False)
    console.print(f"metrics:     {layout.url(layout.metrics_path)}", highlight=False)
    console.print(f"tensorboard: tensorboard --logdir {tensorboard_dir_for(layout)}", highlight=False)
    # Commands that work as printed: on MinIO/moto/Ceph without --endpoint-url they would ask AWS.
    endpoint = ["--endpoint-url", cfg.storage.endpoint_url] if cfg.storage.endpoint_url else []
    plot = ["ppoflow", "runs", "plot", cfg.run.name, "--root", cfg.run.root, *endpoint]
    stats = ["ppoflow", "shards", "stats", layout.url(layout.stage_dir(last, "scored")), *endpoint]
    # soft_wrap: a command is one line however narrow the terminal (a wrap inserted here would break a copy)
    console.print(f"plot:        {shlex.join(plot)}", highlight=False, soft_wrap=True)
    console.print(f"inspect:     {shlex.join(stats)}", highlight=False, soft_wrap=True)


def demo_config(overrides: list[str], root: str = "./runs") -> PPOFlowConfig:
    """The demo's config (configs/demo.yaml + `overrides`) with the tiny model and the digits data under ROOT.

    Builds nothing: `prepare_demo` makes the model and the dataset (once) before training.
    """
    root_path = os.path.abspath(root)
    base = [
        f"run.root={root_path}",
        f"model.policy_path={os.path.join(root_path, '_models', 'tiny-llama')}",
        f"data.path={os.path.join(root_path, '_data', 'digits')}",
        f"eval.data_path={os.path.join(root_path, '_data', 'digits-eval')}",
    ]
    return load_config(DEMO_CONFIG, base + list(overrides))


def prepare_demo(cfg: PPOFlowConfig) -> None:
    """Build the tiny model, the digits dataset and its eval set where `demo_config` put them, unless they exist."""
    from engines.toy.model import ensure_tiny_llama
    from engines.toy.task import ensure_digits_dataset

    ensure_tiny_llama(cfg.model.policy_path)
    ensure_digits_dataset(cfg.data.path)
    if cfg.eval.data_path:  # 64 prompts drawn with another seed (the toy task has only 40 distinct prompts)
        ensure_digits_dataset(cfg.eval.data_path, num_rows=64, seed=1)


def demo(overrides: list[str], root: str = "./runs", console: Optional[Console] = None) -> dict[str, Any]:
    """Build the tiny model and the digits dataset under ROOT (once), then train on the embedded default."""
    cfg = demo_config(overrides, root)
    prepare_demo(cfg)
    return train(cfg, console)
