"""The stages of a PPO iteration, each ONE function, pure of Prefect:

    rollout.run_rollout(cfg, i, PolicyRef)              -> RolloutManifest
    score.run_score(cfg, i, RolloutManifest)            -> ScoreManifest
    update.run_update(cfg, i, PolicyRef, ScoreManifest) -> UpdateManifest
    checkpoint.run_checkpoint(cfg, i, UpdateManifest)   -> CheckpointManifest
    evaluate.run_eval(cfg, i, PolicyRef)                -> EvalManifest    (after the checkpoint, when due)

With pipeline.rollout_parts > 1 the rollout is rollout_parts.run_rollout_part per part (-> RolloutPartManifest),
then rollout_parts.merge_rollout_parts (-> the iteration's RolloutManifest).

Reward-model training (`ppoflow train-rm`, flows/rm_training.py) has its stages here too, typed the same way
(reward_model.py; "iteration" is the unit):

    reward_model.run_rm_prepare(cfg)                             -> RMPlan
    reward_model.run_rm_unit(cfg, unit, RMPlan, RMCheckpointRef) -> RMUnitManifest
    reward_model.run_rm_export(cfg, RMPlan, RMCheckpointRef)     -> RMExportManifest

The Prefect tasks (tasks/), the stage flows that pool workers run (runtime/stage_runs.py) and the in-process
pipeline call exactly these; the bare loop (stages/loop.py) calls their compute halves (`sample_rollout`,
`score_rows`, `train_on`) with the tables in memory instead of shards. This is the floor that reads and writes the
run's storage for the stages; the hand-offs are typed (stages/manifests.py), a stage reads the shards a
hand-off names at its uri, checked against its content hash (handed.py), and the
engines a worker keeps warm between stages are in stages/held.py. With train.num_ranks > 1,
run_update drives the torchrun group of ranks this process is rank 0 of (update_ranks.py; the bare loop trains on
one rank).
"""
