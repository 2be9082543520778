"""What a person sees from `ppoflow demo`: a progress line and the iteration table on stdout, nothing from
the engines or Prefect (their output is in the run's log file); TensorBoard events and a plot of the run;
and one message, no traceback, when a stage fails.

The real CLI runs in a subprocess against the session's Prefect server, with the demo's own config cut
down by `--set` (HF generate instead of vLLM, 8 prompts x 2 samples of 4 tokens) so that a run takes
seconds of compute. vLLM's quiet path is checked by hand (see the report in the README's Terminal section).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.terminal import library_lines

REPO = Path(__file__).resolve().parents[2]
ITERATIONS = 3
SMALL = [
    "rollout.engine=hf",
    "rollout.prompts_per_iteration=8",
    "rollout.n_samples=2",
    "rollout.max_new_tokens=4",
    "train.train_batch_size=16",
    "train.micro_batch_size=16",
    "train.ppo_epochs=1",
    "pipeline.retries=0",
]
pytestmark = pytest.mark.slow


def _demo(root: Path, prefect_server: str, *extra: str, model_dir, data_dir) -> subprocess.CompletedProcess:
    # Variables DeepSpeed set in this test process (earlier tests) would make the child reuse its port.
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(PYTHONPATH=str(REPO), PREFECT_API_URL=prefect_server, COLUMNS="120")
    sets = [f"model.policy_path={model_dir}", f"data.path={data_dir}", *SMALL]
    args = [sys.executable, "-m", "cli", "demo", "--root", str(root), "--iterations", str(ITERATIONS)]
    for item in sets:
        args += ["--set", item]
    return subprocess.run(args + list(extra), cwd=root.parent, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, prefect_server, tiny_model_dir, digits_dataset_dir):
    root = tmp_path_factory.mktemp("cli-demo") / "runs"
    result = _demo(root, prefect_server, model_dir=tiny_model_dir, data_dir=digits_dataset_dir)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return root, result


def test_demo_terminal_shows_progress_and_table_only(demo_run):
    root, result = demo_run
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    noise = library_lines(result.stdout + result.stderr)
    assert not noise, "library output reached the terminal:\n" + "\n".join(noise[:20])
    assert "Traceback" not in result.stdout + result.stderr
    header = next(i for i, line in enumerate(lines) if line.split()[:4] == ["iter", "reward", "signal", "kl"])
    rows = [line.split() for line in lines[header + 1 : header + 1 + ITERATIONS]]
    assert [int(r[0]) for r in rows] == list(range(1, ITERATIONS + 1))
    metrics = [json.loads(x) for x in (root / "demo" / "metrics.jsonl").read_text().splitlines()]
    assert [float(r[1]) for r in rows] == pytest.approx([round(m["reward/mean"], 3) for m in metrics], abs=1e-3)
    # issue 53: the share of groups whose rewards differ, beside the reward (printed to 2 decimals)
    assert [float(r[2]) for r in rows] == pytest.approx([m["signal/group_spread"] for m in metrics], abs=0.0051)
    # The bar ends at N/N on a completed run (the watcher used to stop one iteration short).
    progress = [line for line in lines if line.startswith("run demo") and "eta" in line]
    assert progress and f"{ITERATIONS}/{ITERATIONS}" in progress[-1], lines
    # Everything else is in the run's log file: Prefect's state lines and the engines' output.
    logs = list((root / "demo" / "logs").glob("demo-*.log"))
    assert len(logs) == 1
    text = logs[0].read_text()
    assert "Finished in state Completed" in text and "database is locked" not in text
    # Library lines are few enough to read (the run before this change printed 280 lines for 3 iterations).
    assert len(lines) < 20, "\n".join(lines)


def test_tensorboard_events_hold_every_iteration_and_plot_is_a_png(demo_run, tmp_path):
    from tensorboard.backend.event_processing import event_accumulator

    root, _ = demo_run
    metrics = [json.loads(x) for x in (root / "demo" / "metrics.jsonl").read_text().splitlines()]
    acc = event_accumulator.EventAccumulator(
        str(root / "demo" / "tensorboard"), size_guidance={event_accumulator.SCALARS: 0}
    )
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"reward/mean", "kl/mean", "timing/rollout", "timing/update"} <= tags
    events = acc.Scalars("reward/mean")
    assert [e.step for e in events] == list(range(1, ITERATIONS + 1))
    # Event files store float32: compare against the float32 rounding of the JSON value.
    assert [e.value for e in events] == pytest.approx([m["reward/mean"] for m in metrics], rel=1e-6, abs=1e-7)

    out = tmp_path / "plot.png"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    plotted = subprocess.run(
        [sys.executable, "-m", "cli", "runs", "plot", "demo", "--root", str(root), "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plotted.returncode == 0, plotted.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    image = matplotlib.image.imread(str(out))
    assert image.shape[0] > 100 and image.shape[1] > 100


def test_a_failing_reward_gives_one_message_and_the_traceback_in_the_log(
    tmp_path, prefect_server, tiny_model_dir, digits_dataset_dir
):
    boom = tmp_path / "boom.py"
    boom.write_text(
        "def reward_func(queries, prompts, labels, **kwargs):\n"
        "    raise ValueError('boom: this reward function always fails')\n"
    )
    root = tmp_path / "runs"
    source = f"reward.sources=[{{kind: function, target: '{boom}:reward_func'}}]"
    result = _demo(root, prefect_server, "--set", source, model_dir=tiny_model_dir, data_dir=digits_dataset_dir)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert out.count("error:") == 1, out
    assert "Traceback" not in out
    assert "boom: this reward function always fails" in out
    assert "stage score, iteration 1, run demo" in out
    resume = next(line for line in out.splitlines() if line.strip().startswith("resume:"))
    assert "ppoflow demo --root" in resume and "--verbose" not in resume
    # Issue 56: the UI's Retry too, not only the CLI's resume: the failed flow run's page on this server.
    retry = next(line for line in out.splitlines() if line.strip().startswith("retry:"))
    flow_run_id = retry.split("/runs/flow-run/")[1].split()[0]
    assert retry.split()[1] == f"{prefect_server.removesuffix('/api')}/runs/flow-run/{flow_run_id}", retry
    assert f"prefect flow-run retry {flow_run_id}" in retry and "ppoflow serve" in retry
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_server}), get_client(sync_client=True) as client:
        failed = client.read_flow_run(flow_run_id)
        assert failed.state.is_failed() and failed.name == "ppo-training-demo", failed.state
        assert "score stage of iteration 1 failed" in failed.state.message, failed.state.message
    log_line = next(line for line in out.splitlines() if line.strip().startswith("log:"))
    log_file = Path(log_line.split()[1])
    assert log_file.parent == root / "demo" / "logs"
    text = log_file.read_text()
    assert "Traceback (most recent call last)" in text and "boom: this reward function always fails" in text
