"""flows/logs.py's capture: everything written to fds 1 and 2, by this process, a subprocess and a spawned
multiprocessing child (how vLLM starts its engine core), lands in the run's log file and not on the terminal;
only what ppoflow writes to `capture.terminal` reaches it. For an S3 root the file is written to the local
mirror and copied into the bucket."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import multiprocessing, os, subprocess, sys
from ppoflow.config import PPOFlowConfig
from flows.logs import capture_output

def child_says():
    print("from-spawned-child", flush=True)
    os.write(2, b"from-spawned-child-fd2\\n")

if __name__ == "__main__":
    cfg = PPOFlowConfig.model_validate({"run": {"name": "cap", "root": sys.argv[1]},
                                        "storage": {"endpoint_url": sys.argv[2] or None}})
    capture = capture_output(cfg, "train")
    print("from-parent-stdout")
    print("from-parent-stderr", file=sys.stderr)
    os.write(2, b"from-parent-fd2\\n")
    subprocess.run([sys.executable, "-c", "import sys; print('from-subprocess'); print('sub-err', file=sys.stderr)"])
    proc = multiprocessing.get_context("spawn").Process(target=child_says)
    proc.start()
    proc.join()
    capture.terminal.write("to-terminal\\n")
    capture.terminal.write(f"log={capture.log_path}\\n")
    capture.terminal.write(f"published={capture.publish(cfg.storage)}\\n")
"""
EXPECTED = [
    "from-parent-stdout",
    "from-parent-stderr",
    "from-parent-fd2",
    "from-subprocess",
    "sub-err",
    "from-spawned-child",
    "from-spawned-child-fd2",
]


def _run(tmp_path: Path, root: str, endpoint: str = "") -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    script = tmp_path / "capture_script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PPOFLOW_CACHE": str(tmp_path / "cache")}
    result = subprocess.run(
        [sys.executable, str(script), root, endpoint], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    fields = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    return result, fields


def test_local_run_output_goes_to_the_log_file_and_only_ppoflow_reaches_the_terminal(tmp_path):
    result, fields = _run(tmp_path, str(tmp_path / "runs"))
    assert result.stdout.splitlines()[0] == "to-terminal" and result.stderr == ""
    for text in EXPECTED:
        assert text not in result.stdout
    log = Path(fields["log"])
    assert log.parent == tmp_path / "runs" / "cap" / "logs" and fields["published"] == "None"
    written = log.read_text().splitlines()
    for text in EXPECTED:
        assert text in written, (text, written)


@pytest.mark.slow
def test_s3_run_log_is_mirrored_locally_and_copied_to_the_bucket(tmp_path, s3_bucket, s3_server):
    bucket, storage_cfg = s3_bucket
    result, fields = _run(tmp_path, f"s3://{bucket}/runs", s3_server)
    assert result.stderr == ""
    log = Path(fields["log"])
    assert str(log).startswith(str(tmp_path / "cache" / "mirror")) and log.parent.name == "logs"
    assert fields["published"] == f"s3://{bucket}/runs/cap/logs/{log.name}"
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, client_kwargs={"endpoint_url": s3_server})
    remote = fs.cat_file(f"{bucket}/runs/cap/logs/{log.name}").decode().splitlines()
    for text in EXPECTED:
        assert text in remote


PTY_SCRIPT = """
import logging, sys
from rich.console import Console
from flows.logs import OutputCapture, terminal_width
from flows.run import progress_bar

width = terminal_width(1)  # as cli/capture.py: taken before the capture; this pty reports 0 columns
capture = OutputCapture(sys.argv[1]).start()
console = Console(file=capture.terminal, width=width)
assert console.is_terminal
with progress_bar(console) as progress:
    task = progress.add_task("run x", total=2)
    for step in (1, 2):
        progress.console.print(f"row-{step}")
        print("library-print")
        logging.getLogger("some.library").warning("library-warning")
        progress.update(task, completed=step)
"""


def test_on_a_terminal_the_bar_does_not_bring_library_output_back(tmp_path):
    """On a real terminal (a pty here) rich's progress bar would redirect sys.stdout/stderr above the bar by
    default; the capture must still send library output to the log file only."""
    import pty
    import select

    script = tmp_path / "pty_script.py"
    script.write_text(PTY_SCRIPT)
    log = tmp_path / "pty.log"
    master, slave = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(REPO), "TERM": "xterm"}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(log)], stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True
    )
    os.close(slave)
    seen = b""
    while True:
        ready, _, _ = select.select([master], [], [], 60)
        if not ready:
            break
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the pty
            break
        if not chunk:
            break
        seen += chunk
    assert proc.wait(timeout=60) == 0, seen.decode(errors="replace")
    os.close(master)
    terminal = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", seen.decode(errors="replace"))  # colours, cursor moves
    assert "row-1" in terminal and "row-2" in terminal and "2/2" in terminal
    assert "library-print" not in terminal and "library-warning" not in terminal
    written = log.read_text()
    assert written.count("library-print") == 2 and written.count("library-warning") == 2


@pytest.mark.slow
def test_a_retry_executed_by_serve_writes_a_run_log_of_its_own(prefect_api, tmp_path, tiny_model_dir):
    # Issue 56: `ppoflow train` logs to <run>/logs/train-*.log, but its Retry, executed by `ppoflow serve` in a
    # process of its own, wrote its output only to serve's stdout. A run whose data file is missing fails in
    # preflight (fast) under both; the retry's log holds its error and traceback, and serve's stdout still shows it.
    import time

    from prefect.client.orchestration import get_client

    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env |= {"PYTHONPATH": str(REPO), "PREFECT_API_URL": prefect_api}
    root = tmp_path / "runs"
    argv = ["train", "/dev/null", "--set", f"run.root={root}", "--set", "run.name=retry-log"]
    argv += ["--set", f"model.policy_path={tiny_model_dir}", "--set", f"data.path={tmp_path / 'missing.jsonl'}"]
    first = subprocess.run([sys.executable, "-m", "cli", *argv], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 2 and "missing.jsonl" in first.stdout + first.stderr, first.stdout + first.stderr
    logs = root / "retry-log" / "logs"
    assert [p.name.split("-")[0] for p in logs.iterdir()] == ["train"]
    flow_run_id = re.search(r"/runs/flow-run/([0-9a-f-]{36})", first.stdout + first.stderr).group(1)

    serve_out = open(tmp_path / "serve.log", "w")
    serve = subprocess.Popen([sys.executable, "-m", "cli", "serve"], cwd=REPO, env=env, stdout=serve_out,
                             stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        retried = subprocess.run(
            [sys.executable, "-m", "prefect", "flow-run", "retry", flow_run_id],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert retried.returncode == 0, retried.stdout + retried.stderr
        deadline = time.time() + 240
        with get_client(sync_client=True) as client:
            while time.time() < deadline:
                run = client.read_flow_run(flow_run_id)
                if run.run_count >= 2 and run.state.is_final():
                    break
                time.sleep(2)
    finally:
        serve.terminate()
        try:
            serve.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, 9)  # its own session: the runner's children go too
    served = (tmp_path / "serve.log").read_text()
    assert run.run_count >= 2 and run.state.is_failed(), (run.state, served[-3000:])
    (retry_log,) = [p for p in logs.iterdir() if p.name.startswith("flow-run-")]
    text = retry_log.read_text()
    assert "missing.jsonl" in text and "Traceback (most recent call last)" in text, text[-3000:]
    assert "missing.jsonl" in served  # the tee: serve's stdout still shows the run's output
