"""flows/failure.py: the one message a failed command prints (what, where, log, resume), without a traceback."""

from __future__ import annotations

from flows.failure import describe_failure, failed_stage, resume_command
from ppoflow.config import PPOFlowConfig


def _raise_inside_a_stage(stage: str, iteration: int) -> None:
    # Mirrors flows/stages.run_stage: the stage and iteration are locals of the frame that runs the stage.
    def body():
        raise FileNotFoundError("data file /data/prompts.jsonl: row 12 has no 'prompt' column")

    body()


def _caught(stage: str = "rollout", iteration: int = 4) -> BaseException:
    try:
        _raise_inside_a_stage(stage, iteration)
    except FileNotFoundError as e:
        return e
    raise AssertionError("did not raise")


def test_stage_and_iteration_come_from_the_failing_frame():
    assert failed_stage(_caught("score", 7).__traceback__) == ("score", 7)
    # A local named `stage` that is not a stage name does not count.
    assert failed_stage(_caught("not-a-stage", 2).__traceback__) == (None, 2)


def test_message_names_what_where_log_and_resume_for_an_s3_run():
    cfg = PPOFlowConfig.model_validate(
        {
            "run": {"name": "exp1", "root": "s3://no-such-bucket/ppo"},
            "storage": {"endpoint_url": "http://127.0.0.1:9000"},
        }
    )
    argv = ["train", "my run.yaml", "--set", "run.iterations=5", "--verbose"]
    text = describe_failure(_caught(), cfg, "/cache/mirror/x/exp1/logs/train-1.log", argv=argv)
    lines = text.splitlines()
    assert lines[0] == (
        "ppoflow: error: FileNotFoundError: data file /data/prompts.jsonl: row 12 has no 'prompt' column"
    )
    assert "  where:   stage rollout, iteration 4, run exp1 at s3://no-such-bucket/ppo/exp1" in lines
    assert "  storage: s3://no-such-bucket/ppo (endpoint http://127.0.0.1:9000)" in lines
    assert any(line.startswith("  log:     /cache/mirror/x/exp1/logs/train-1.log") for line in lines)
    # The same command without --verbose, quoted for a shell.
    assert lines[-1] == "  resume:  ppoflow train 'my run.yaml' --set run.iterations=5"
    assert text.count("error:") == 1 and "Traceback" not in text


def test_a_local_run_has_no_storage_line_and_long_messages_are_cut():
    cfg = PPOFlowConfig.model_validate({"run": {"name": "loc", "root": "/tmp/runs"}})
    error = RuntimeError("\n".join(f"line {i}" for i in range(40)))
    text = describe_failure(error, cfg, None, argv=["demo"])
    assert "storage:" not in text and "where:   run loc at /tmp/runs/loc" in text
    assert "line 11" in text and "line 12" not in text and "(28 more lines in the log file)" in text
    assert resume_command(["demo", "--verbose", "--root", "x"]) == "ppoflow demo --root x"


def test_a_pool_stage_s_own_error_leads_the_training_run_s_message():
    # Issue 56: on pools the training run's state said "StageFailed: ... ended FAILED", without the error.
    from prefect.states import Crashed, Failed

    from flows.failure import StageError
    from runtime.pool_deployments import stage_run_error
    from runtime.stage_runs import StageFailed

    state = Failed(message="Flow run encountered an exception: RewardError: reward function boom.py:reward raised")
    assert stage_run_error(state) == "RewardError: reward function boom.py:reward raised"
    assert stage_run_error(Crashed(message="Execution was aborted by an interrupt signal.")) == (
        "Execution was aborted by an interrupt signal."
    )
    assert stage_run_error(Failed(message=None)) is None
    where = "flow run score-iter-2 (1234) on deployment 'ppo-score/ppo-score'"
    cause = StageFailed(f"stage score of iteration 2 ran as {where} and ended FAILED", stage_run_error(state), where)
    assert str(StageError("score", 2, cause)) == (
        f"score stage of iteration 2 failed: RewardError: reward function boom.py:reward raised ({where})"
    )
    import pickle

    again = pickle.loads(pickle.dumps(cause))
    assert (str(again), again.stage_error, again.where) == (str(cause), cause.stage_error, cause.where)


def test_a_failure_offers_the_flow_run_s_retry_when_its_server_outlives_the_command(monkeypatch):
    # Issue 56: the message offered only the CLI's resume, not the UI's Retry of the failed flow run.
    from prefect.settings import PREFECT_API_URL, temporary_settings

    error = _caught()
    error.ppoflow_flow_run = {"name": "ppo-training-exp1", "id": "0b1c"}
    cfg = PPOFlowConfig.model_validate({"run": {"name": "exp1", "root": "/data/runs"}})
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:4200/api"}):
        text = describe_failure(error, cfg, None, argv=["train", "exp1.yaml"])
    assert text.splitlines()[-1] == (
        "  retry:   http://127.0.0.1:4200/runs/flow-run/0b1c (Retry in the Prefect UI, or `prefect flow-run retry "
        "0b1c`), with `ppoflow serve` running: it resumes at the stage that failed"
    )
    with temporary_settings({PREFECT_API_URL: None}):  # a temporary server: gone with the command, no retry
        assert "retry:" not in describe_failure(error, cfg, None, argv=["train", "exp1.yaml"])
