"""The checks a run passes before its first iteration: `preflight(cfg)`, called at the top of ppo_training.

1. flows/preflight_static.py static_problems: storage root (S3 bucket), data file, model folders, reward sources;
2. the deployments named in `pipeline.stage_pools` exist on the Prefect server (the error lists the ones
   that do, so a misspelt name is seen at once instead of as `ObjectNotFound: None` inside iteration 1);
3. prompt lengths, when the rollout runs in this process: the rollout stage's own PromptSource is built
   now (stages/held.py `prompt_source_for`, kept warm in this process), so the dataset is tokenised once
   for both the check and the training, and an over-long prompt is named by its row before any work.
   When the rollout runs on a pool, its worker tokenises the data; tokenising a large dataset here too
   would pay that cost twice, so the lengths are then checked by the worker (first rollout, same error).
   The longest prompt plus rollout.max_new_tokens is checked against the policy's context then too
   (flows/preflight_limits.py room_problems, with a fix).

4. the latest committed checkpoint can resume on `train.num_ranks` ranks (a run saved by another number of
   ranks resumes where engines/trainer/reshard.py can re-cut it; otherwise one error naming both counts,
   before any rollout, instead of an error in the update stage).

Problems of steps 1 and 2 are gathered and raised as one PreflightError (a ConfigError, which the CLI prints
as a message, not a traceback). Nothing here writes to the run's storage.
"""

from __future__ import annotations

from flows.preflight_limits import room_problems
from flows.preflight_static import PreflightError, format_problems, static_problems
from ppoflow.config import PPOFlowConfig


def deployment_problems(cfg: PPOFlowConfig) -> list[str]:
    """One problem per deployment of `pipeline.stage_pools` that the Prefect server does not know."""
    pools = cfg.pipeline.stage_pools or {}
    return unknown_deployments({f"pipeline.stage_pools.{stage}": name for stage, name in pools.items()})


def unknown_deployments(named: dict[str, str]) -> list[str]:
    """One problem per `{where it is named: FLOW/DEPLOYMENT}` that the Prefect server does not know, listing the
    deployments it does know."""
    if not named:
        return []
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    missing = []
    with get_client(sync_client=True) as client:
        for where, name in named.items():
            try:
                client.read_deployment_by_name(name)
            except ObjectNotFound:
                missing.append((where, name))
        if not missing:
            return []
        flows = {f.id: f.name for f in client.read_flows()}
        existing = sorted(f"{flows.get(d.flow_id, '?')}/{d.name}" for d in client.read_deployments())
        api = client.api_url
    known = ", ".join(existing) if existing else "none"
    return [
        f"{where}: deployment {name!r} does not exist on the Prefect server at {api} "
        f"(deployments there: {known}; `prefect deploy --all` creates ppoflow's)"
        for where, name in missing
    ]


def check_prompt_lengths(cfg: PPOFlowConfig) -> None:
    """Tokenise the dataset through the rollout stage's warm PromptSource (see the module docstring). A
    tokenizer that does not load is the policy folder's problem (model.policy_path), not the data's."""
    from engines.models import TokenizerError
    from stages.held import prompt_source_for

    try:
        source = prompt_source_for(cfg)
    except TokenizerError as e:
        raise PreflightError(format_problems(cfg, [f"model.policy_path: {e}"])) from None
    except (KeyError, ValueError) as e:  # PromptSource names the file and the row
        raise PreflightError(format_problems(cfg, [f"data.path: {e.args[0] if e.args else e}"])) from None
    if problems := room_problems(cfg, source.prompt_ids):  # longest prompt + max_new_tokens within the context
        raise PreflightError(format_problems(cfg, problems))


def rank_count_problems(cfg: PPOFlowConfig) -> list[str]:
    """A problem when the run's latest checkpoint was saved by a number of ranks it cannot resume on."""
    from stages.update_ranks import check_saved_ranks
    from storage.checkpoints import latest_iteration, load_checkpoint
    from storage.layout import layout_for

    layout = layout_for(cfg)
    if not layout.fs.exists(layout.run_dir) or not (latest := latest_iteration(layout)):
        return []
    try:  # only trainer/ is fetched (trainer.json names the rank count that saved it)
        check_saved_ranks(load_checkpoint(layout, latest, parts=("trainer",)), cfg.train.num_ranks, cfg)
    except ValueError as e:
        return [f"train.num_ranks: {e}"]
    return []


def preflight(cfg: PPOFlowConfig) -> None:
    """Raise PreflightError naming every problem found before the first iteration; see the module docstring."""
    problems = static_problems(cfg) + deployment_problems(cfg)
    if problems:
        raise PreflightError(format_problems(cfg, problems))
    if problems := rank_count_problems(cfg):
        raise PreflightError(format_problems(cfg, problems))
    if "rollout" not in (cfg.pipeline.stage_pools or {}):
        check_prompt_lengths(cfg)
