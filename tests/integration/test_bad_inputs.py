"""A catalogue of bad inputs, each refused before any work with a message that names what and where.

One run ("kept") is trained for one iteration first; every bad input below is then aimed at that same run
(same root and name, as a user resuming it with a mistake would), and after each refusal:
- the message names the field and the file, line, row, bucket or deployment;
- no rollout ran (no iter-000002/ folder, the iteration the resume would start);
- it failed fast (static inputs: seconds, against the ~10 s a toy iteration takes on this machine);
- every file of the existing run is byte-identical (sha256 of the whole folder before and after).

Most cases go through the config loader and flows.preflight.preflight in this process (what ppo_training
calls first); five go through the real CLI (`python -m cli train CONFIG --set ...`) in a subprocess
and also assert its exit code, as do a config file with a key given twice and a PREFECT_API_URL that does
not answer.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.integration.pipeline_helpers import small_config

pytestmark = pytest.mark.slow

RUN = "kept"


def folder_digest(folder: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under `folder` but the CLI's log files (logs/: each command adds
    one, holding the refused start's traceback; nothing the run had committed)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.relative_to(folder).parts[0] != "logs"
    }


@pytest.fixture(scope="module")
def kept_run(tmp_path_factory, tiny_model_dir, digits_dataset_dir, prefect_server):
    """(config YAML path, run folder, sha256 digest, bad-input folder) of a run with one committed iteration."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.training import ppo_training

    work = tmp_path_factory.mktemp("bad-inputs")
    cfg = small_config(str(work / "runs"), RUN, tiny_model_dir, digits_dataset_dir, iterations=1)
    with temporary_settings(updates={PREFECT_API_URL: prefect_server}):
        assert ppo_training(config=cfg.model_dump(mode="json"), return_state=True).is_completed()
    # The resume a user would start: one more iteration of the same run.
    config_path = work / "kept.yaml"
    config_path.write_text(cfg.model_copy(update={"run": cfg.run.model_copy(update={"iterations": 2})}).to_yaml())
    run_dir = work / "runs" / RUN
    bad = _bad_files(work / "bad", tiny_model_dir)
    return config_path, run_dir, folder_digest(run_dir), bad


def _bad_files(folder: Path, model_dir: Path) -> Path:
    """Broken copies of the inputs: data files and model folders, each wrong in one way."""
    folder.mkdir()
    (folder / "empty.jsonl").write_text("")
    (folder / "latin1.jsonl").write_bytes(
        '{"prompt": "a", "label": "1"}\n{"prompt": "caf\xe9", "label": "2"}\n'.encode("latin-1")
    )
    (folder / "broken.jsonl").write_text('{"prompt": "a", "label": "1"}\n{"prompt": "b", "label": "2"}\n{"prompt"\n')
    (folder / "nolabel.jsonl").write_text('{"prompt": "a", "label": "1"}\n{"prompt": "b"}\n')
    (folder / "data.csv").write_text("prompt,label\na,1\n")
    truncated = shutil.copytree(model_dir, folder / "truncated-model")
    weights = truncated / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)  # a download cut off half-way
    no_config = shutil.copytree(model_dir, folder / "no-config-model")
    (no_config / "config.json").unlink()
    no_tokenizer = shutil.copytree(model_dir, folder / "no-tokenizer-model")
    (no_tokenizer / "tokenizer.json").unlink()
    (folder / "blank.jsonl").write_text('{"prompt": "a", "label": "1"}\n{"prompt": " \\t ", "label": "2"}\n')
    (folder / "nulllabel.jsonl").write_text('{"prompt": "a", "label": "1"}\n{"prompt": "b", "label": null}\n')
    pq.write_table(pa.table({"prompt": ["a", "", "c"], "label": ["1", "2", "3"]}), folder / "empty-prompt.parquet")
    cut_tokenizer = shutil.copytree(model_dir, folder / "cut-tokenizer-model")
    text = (cut_tokenizer / "tokenizer.json").read_text()
    (cut_tokenizer / "tokenizer.json").write_text(text[: len(text) // 2])  # a download cut off half-way
    odd_tokenizer = shutil.copytree(model_dir, folder / "odd-tokenizer-model")  # JSON, but not a tokenizer
    (odd_tokenizer / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nonsense"}}')
    return folder


# (id, overrides, fragments the message must hold). "{bad}" is the folder of broken inputs.
CONFIG_CASES = [
    (
        "weight-nan",
        ["reward.sources=[{kind: function, target: 'engines.toy.task:reward_func', weight: .nan}]"],
        ["reward.sources.0.weight", "NaN", "finite"],
    ),
    ("no-sources", ["reward.sources=[]"], ["reward.sources", "at least 1"]),
    ("name-dotdot", ["run.name=.."], ["run.name", '".."', "plain folder name"]),
    ("name-dot", ["run.name=."], ["run.name", '"."', "score cache"]),
    ("top-k", ["rollout.top_k=-7"], ["rollout.top_k", "-7", "-1"]),
    ("max-model-len", ["rollout.max_model_len=-3"], ["rollout.max_model_len", "-3", "greater than or equal to 1"]),
    ("grad-norm", ["train.max_grad_norm=-1"], ["train.max_grad_norm", "-1", "greater than 0"]),
    ("dual-clip", ["algo.dual_clip=0.5"], ["algo.dual_clip", "0.5", "greater than 1"]),
    ("clip-low", ["algo.clip_low=5"], ["algo.clip_low", "5", "less than 1"]),
    ("kl-target", ["algo.kl_target=-1"], ["algo.kl_target", "-1", "greater than 0"]),
    ("stop-token", ["rollout.stop_token_ids=[-5]"], ["rollout.stop_token_ids.0", "-5", "greater than or equal to 0"]),
    ("bool-int", ["rollout.n_samples=true"], ["rollout.n_samples", "true (bool)", "valid integer"]),
    ("batch-zero", ["train.train_batch_size=0"], ["train.train_batch_size", "0", "greater than or equal to 1"]),
    ("batch-negative", ["train.train_batch_size=-4"], ["train.train_batch_size", "-4", "greater than or equal to 1"]),
    ("batch-not-dividing", ["train.train_batch_size=5"], ["train.train_batch_size=5", "divide the rollout batch"]),
    (
        "micro-not-dividing",
        ["train.train_batch_size=16", "train.micro_batch_size=6"],
        ["train.micro_batch_size=6", "16"],
    ),
    ("ranks-zero", ["train.num_ranks=0"], ["train.num_ranks", "0", "greater than or equal to 1"]),
    ("ranks-not-dividing", ["train.num_ranks=3"], ["train.num_ranks=3", "train batch of 16"]),
    (
        "pool-typo",
        ["pipeline.stage_pools={rollut: ppo-rollout/ppo-rollout}"],
        ["pipeline.stage_pools", "'rollut'", "rollout, score, update, checkpoint"],
    ),
    ("kl-inf", ["algo.kl_coef=.inf"], ["algo.kl_coef", "Infinity", "finite"]),
    ("value-clip", ["algo.value_clip=0"], ["algo.value_clip", "greater than 0"]),
    ("unknown-key", ["algo.kl_coeff=0.1"], ["algo.kl_coeff", "Extra inputs are not permitted"]),
    ("remote-no-url", ["reward.sources=[{kind: remote, target: 'localhost:8000'}]"], ["reward.sources.0", "http://"]),
]

PREFLIGHT_CASES = [
    ("data-missing", ["data.path={bad}/nope.jsonl"], ["data.path", "nope.jsonl' not found"]),
    ("data-no-column", ["data.label_key=answer"], ["data.path", "no column 'answer' (data.label_key)"]),
    ("data-empty", ["data.path={bad}/empty.jsonl"], ["data.path", "empty.jsonl' is empty"]),
    ("data-not-utf8", ["data.path={bad}/latin1.jsonl"], ["latin1.jsonl' line 2: not UTF-8", "0xe9"]),
    ("data-not-json", ["data.path={bad}/broken.jsonl"], ["broken.jsonl' line 3: not JSON"]),
    (
        "data-label-missing-on-a-line",
        ["data.path={bad}/nolabel.jsonl"],
        ["nolabel.jsonl' line 2: no key 'label' (data.label_key)"],
    ),
    ("data-csv", ["data.path={bad}/data.csv"], ["data.csv", "unsupported file type '.csv'"]),
    (
        "prompt-whitespace",
        ["data.path={bad}/blank.jsonl"],
        ["data.path", "blank.jsonl' line 2: the prompt (data.prompt_key='prompt') is only whitespace"],
    ),
    (
        "prompt-empty-parquet",
        ["data.path={bad}/empty-prompt.parquet"],
        ["data.path", "empty-prompt.parquet' row 1: the prompt (data.prompt_key='prompt') is empty"],
    ),
    (
        "label-null",  # the kept run's reward, engines.toy.task:reward_func, is passed labels
        ["data.path={bad}/nulllabel.jsonl"],
        [
            "data.path",
            "nulllabel.jsonl' line 2: the label (data.label_key='label') is null, and "
            "reward.sources.0 (function engines.toy.task:reward_func) would be passed it as None",
        ],
    ),
    ("prompt-too-long", ["data.max_prompt_tokens=2"], ["data.path", "row ", "max_prompt_tokens=2"]),
    ("policy-missing", ["model.policy_path={bad}/no-model"], ["model.policy_path", "no-model' not found"]),
    (
        "policy-truncated",
        ["model.policy_path={bad}/truncated-model"],
        ["model.policy_path", "truncated-model/model.safetensors", "(truncated)"],
    ),
    (
        "policy-no-config",
        ["model.policy_path={bad}/no-config-model"],
        ["model.policy_path", "no-config-model/config.json is missing"],
    ),
    (
        "policy-no-tokenizer",
        ["model.policy_path={bad}/no-tokenizer-model"],
        ["model.policy_path", "no-tokenizer-model: no tokenizer files"],
    ),
    (
        "policy-tokenizer-cut",
        ["model.policy_path={bad}/cut-tokenizer-model"],
        ["model.policy_path", "cut-tokenizer-model/tokenizer.json: not valid JSON"],
    ),
    (
        "policy-tokenizer-does-not-load",  # before: "data.path: ..." (the tokenizer loads with the prompts)
        ["model.policy_path={bad}/odd-tokenizer-model"],
        ["model.policy_path: the tokenizer in {bad}/odd-tokenizer-model does not load"],
    ),
    (
        "stop-token-outside-vocab",
        ["rollout.stop_token_ids=[2, 64]"],
        ["rollout.stop_token_ids", "[64]", "vocab_size 64"],
    ),  # the tiny Llama's ids are 0..63
    ("critic-truncated", ["model.critic_path={bad}/truncated-model"], ["model.critic_path", "(truncated)"]),
    (
        "reward-file-missing",
        ["reward.sources=[{kind: function, target: '{bad}/rewards.py:score'}]"],
        ["reward.sources.0.target", "rewards.py' not found"],
    ),
    (
        "reward-model-missing",
        ["reward.sources=[{kind: model, target: '{bad}/no-rm'}]"],
        ["reward.sources.0.target", "no-rm' not found"],
    ),
    (
        "deployment-missing",
        ["pipeline.stage_pools={score: ppo-score/not-deployed}"],
        ["pipeline.stage_pools.score", "'ppo-score/not-deployed' does not exist", "deployments there:"],
    ),
]


def _check_refusal(message: str, fragments: list[str], run_dir: Path, digest: dict[str, str]) -> None:
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in:\n{message}"
    assert not (run_dir / "iter-000002").exists(), "a rollout started"
    assert folder_digest(run_dir) == digest, "the existing run's files changed"


def _refuse_in_process(config_path: Path, overrides: list[str]) -> str:
    from flows.preflight import preflight
    from ppoflow.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        preflight(load_config(config_path, overrides))
    return str(err.value)


@pytest.mark.parametrize(
    "case, overrides, fragments", CONFIG_CASES + PREFLIGHT_CASES, ids=[c[0] for c in CONFIG_CASES + PREFLIGHT_CASES]
)
def test_refused_before_work(kept_run, prefect_api, case, overrides, fragments):
    config_path, run_dir, digest, bad = kept_run
    overrides = [o.replace("{bad}", str(bad)) for o in overrides]
    start = time.monotonic()
    message = _refuse_in_process(config_path, overrides)
    elapsed = time.monotonic() - start
    _check_refusal(message, [f.replace("{bad}", str(bad)) for f in fragments], run_dir, digest)
    assert elapsed < 5.0, f"{case} took {elapsed:.1f} s to fail"


def test_missing_bucket_is_named(kept_run, s3_server):
    config_path, run_dir, digest, _bad = kept_run
    message = _refuse_in_process(
        config_path, ["run.root=s3://no-such-bucket/runs", f"storage.endpoint_url={s3_server}"]
    )
    _check_refusal(message, ["run.root", "bucket 'no-such-bucket' does not exist", s3_server], run_dir, digest)


# Through the real CLI: config errors fail in the loader (about 1 s), a preflight error inside the training flow
# (after Prefect starts the flow run, ~14 s here), a changed setting at the run folder's config check after
# preflight; all before a rollout.
CLI_CASES = [
    ("bool-int", ["rollout.n_samples=true"], ["rollout.n_samples", "true (bool)"]),
    ("name-dotdot", ["run.name=.."], ["run.name", "plain folder name"]),
    ("data-missing", ["data.path={bad}/nope.jsonl"], ["data.path", "nope.jsonl' not found"]),
    ("unknown-key", ["algo.kl_coeff=0.1"], ["algo.kl_coeff", "Extra inputs are not permitted"]),
    ("changed-setting", ["algo.kl_coef=0.5"], ["config.yaml", "algo.kl_coef"]),
]


@pytest.mark.parametrize("case, overrides, fragments", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_refuses_with_an_exit_code(kept_run, prefect_api, case, overrides, fragments):
    config_path, run_dir, digest, bad = kept_run
    args = [a for o in overrides for a in ("--set", o.replace("{bad}", str(bad)))]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "cli", "train", str(config_path), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    elapsed = time.monotonic() - start
    assert done.returncode != 0, done.stdout[-2000:]
    _check_refusal(done.stdout + done.stderr, [f.replace("{bad}", str(bad)) for f in fragments], run_dir, digest)
    # Interpreter start, imports and the flow run's start on a loaded 2-core machine; no model is loaded.
    assert elapsed < 90, f"{case} took {elapsed:.1f} s to fail"


def _cli(args: list[str], **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli", *args],
        env={**os.environ, "PYTHONPATH": os.getcwd(), **env},
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_a_config_key_given_twice_is_named_with_both_lines(kept_run, tmp_path):
    # Before: YAML kept the last value without a word (a new run would have trained with kl_coef 0.5; this resume
    # was refused as a changed setting, naming a key the file seems to set right).
    config_path, run_dir, digest, _bad = kept_run
    lines = config_path.read_text().splitlines()
    algo = lines.index("algo:")
    kl = next(i for i in range(algo + 1, len(lines)) if lines[i].startswith("  kl_coef:"))  # 0-based
    doubled = tmp_path / "doubled.yaml"
    doubled.write_text("\n".join(lines[: kl + 1] + ["  kl_coef: 0.5"] + lines[kl + 1 :]) + "\n")
    done = _cli(["train", str(doubled)])
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    message = f"config file {doubled} line {kl + 2}: key 'kl_coef' is given twice in 'algo' (first on line {kl + 1})"
    _check_refusal(done.stdout + done.stderr, [message], run_dir, digest)


def test_an_unreachable_prefect_api_is_named_with_the_way_out(kept_run):
    import socket

    config_path, run_dir, digest, _bad = kept_run
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/api"
    start = time.monotonic()
    done = _cli(["train", str(config_path)], PREFECT_API_URL=url)
    elapsed = time.monotonic() - start
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    output = done.stdout + done.stderr
    assert output.count("ppoflow: error:") == 1, output
    fragments = [
        f"ppoflow: error: ConfigError: PREFECT_API_URL={url} (set in the environment) does not answer: ConnectError",
        "unset it (`unset PREFECT_API_URL`) to run on a temporary local Prefect server",
    ]
    _check_refusal(output, fragments, run_dir, digest)
    assert elapsed < 60, f"took {elapsed:.1f} s to fail"
