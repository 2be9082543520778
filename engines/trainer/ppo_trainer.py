"""PPOTrainer: one PPO update of the actor (and the critic for algo "ppo") with DeepSpeed.

An update reads as its stages in order:
  1. old log-probs (actor) and old values (critic), no grad, in micro-batches, over this rank's rows; taken from
     the first epoch's own forward when the batch is one step of one micro-batch per rank (`_first_forward`),
     and for the first step's rows from that step's forwards when nothing needs them earlier (first_step_old.py);
     with algo.old_logprobs = rollout the old log-probs are the sampler's and only the critic runs here; with
     several ranks, every rank's rows and outputs are then gathered (rank_rows.py);
  2. the scalar reward shaped (engines.ppo.reward_shaping: reward.normalize, then reward.overlong);
     per-token KL to the reference (algo.kl_estimator); token rewards (KL folded in when algo.kl_in_reward);
  3. advantages and returns (engines.ppo.compute_advantages, the estimator of algo.name's registry entry);
  4. algo.ppo_epochs passes; each shuffles the rows (seeded by run.seed and the update count, so a resumed
     run shuffles exactly like an uninterrupted one) and cuts them into optimizer steps of
     train.train_batch_size rows, each accumulated over micro-batches of train.micro_batch_size
     (loss_steps.py: the losses, their whole-step denominators, the DeepSpeed steps);
  5. the KL controller sees the batch's mean KL per sequence (each response's KL summed over its tokens,
     averaged over responses: the unit of Ziegler et al.'s target, `algo.kl_target`).

Several data-parallel ranks (one DeepSpeed world): rank r of N holds rows [r*B/N, (r+1)*B/N) of the update
batch (`update_rows`; `update` cuts them from a whole batch every rank holds) and runs stage 1 on them only.
The ranks then all-gather those rows with their old log-probs and values, so stages 2, 3 and 5 see the whole
batch on every rank, computed as one rank computes them (group baselines and whitening over all rows); in
stage 4 every step holds the rows one rank's step holds and rank r trains on the r-th 1/N of them, with the
whole step's denominators: the gradient of the token mean over all tokens of the step on all ranks. So N
ranks take the 1-rank update, up to float summation order (see rank_rows.py).
The loss mask is the response mask, without truncated samples when train.mask_truncated is on; with
algo.tis_cap, or with pipelined iterations (pipeline.max_staleness >= 1), the policy-gradient tokens carry truncated
importance weights pi_old / pi_sampler (decoupled PPO: engines/ppo/off_policy.py).

Precision: model.dtype "bfloat16" (the default on a GPU) trains bfloat16 weights with DeepSpeed's bf16 mode:
float32 master weights, gradient accumulation and AdamW state inside the ZeRO-2 optimizer (deepspeed_setup.py),
no cast per forward. model.autocast_dtype ("bfloat16") instead runs every forward (and so its backward) of
float32 weights under torch.autocast; weights, gradients and AdamW state stay float32. Either way log-probs and
values come out float32.

Checkpoints: see engines/trainer/checkpoint.py.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from engines.models import autocast, load_critic, load_tokenizer
from engines.ppo import advantages as ppo_advantages
from engines.ppo.kl import kl_penalty
from engines.ppo.kl_controller import make_kl_controller
from engines.ppo.masked import masked_mean, masked_sum
from engines.ppo.off_policy import behaviour_is_cap, is_weight_metric_names
from engines.ppo.reward_norm import RunningMoments
from engines.ppo.reward_shaping import shape_scores
from engines.ppo.rewards import token_level_rewards
from engines.ppo.signal import signal_metrics
from engines.trainer import checkpoint, lora
from engines.trainer.deepspeed_setup import (
    deepspeed_config,
    lr_multiplier,
    make_engine,
    setup_distributed,
    world_size,
)
from engines.trainer.epoch_order import epoch_order
from engines.trainer.experience import ExperienceBatch
from engines.trainer.first_step_old import defers_old, first_step_rows, old_except
from engines.trainer.forward import PolicyOutput, critic_forward, policy_forward
from engines.trainer.loss_steps import KL_CLAMP, FirstForward, LossSteps, MetricSums
from engines.trainer.mismatch import first_step_mismatch, start_mismatch
from engines.trainer.rank_rows import agree_shape, gather_rows, pad_to, rank_rows
from engines.trainer.state import seed_rng
from engines.trainer.update_metrics import UpdateResult, batch_metrics, ragged, sampler_gap_metric
from ppoflow.algorithms import get_algorithm

__all__ = ["KL_CLAMP", "PPOTrainer", "UpdateResult"]


class PPOTrainer(LossSteps):
    """Actor (and critic) as DeepSpeed engines. `trainer_state_dir` resumes optimizer/scheduler/KL/RNG."""

    def __init__(self, cfg, policy_dir: str, critic_dir: Optional[str] = None, trainer_state_dir: Optional[str] = None):
        setup_distributed()
        if trainer_state_dir is None:
            # A fresh trainer draws new parameters (the critic's value head): seed them from the run, not
            # from whatever the process did before, so a rebuilt run equals an uninterrupted one; Python's and
            # numpy's generators too, whose states every checkpoint holds. A resumed trainer restores its RNG
            # states from the checkpoint instead.
            seed_rng(cfg.run.seed)
        self.cfg = cfg
        self.policy_dir = str(policy_dir)
        self.tokenizer = load_tokenizer(policy_dir)
        self.train_batch_size = cfg.train.train_batch_size or cfg.rollout_batch_size
        steps_per_update = cfg.train.ppo_epochs * (cfg.rollout_batch_size // self.train_batch_size)
        factor = lr_multiplier(cfg.train.warmup_steps, cfg.run.iterations * steps_per_update, cfg.train.lr_schedule)
        policy = lora.load_actor(cfg, policy_dir)  # with gradient checkpointing / LoRA as configured
        self.actor = make_engine(
            policy,
            deepspeed_config(
                cfg.train,
                cfg.model.dtype,
                self.train_batch_size,
                cfg.train.actor_lr,
                cfg.model.autocast_dtype,
                world=world_size(),
            ),
            factor,
        )
        self.critic = None
        if cfg.algo.uses_critic:
            critic = load_critic(
                critic_dir or cfg.model.critic_path or policy_dir, cfg.model.dtype, cfg.model.attn_implementation
            )
            if cfg.model.gradient_checkpointing:
                critic.gradient_checkpointing_enable()
            self.critic = make_engine(
                critic,
                deepspeed_config(
                    cfg.train,
                    cfg.model.dtype,
                    self.train_batch_size,
                    cfg.train.critic_lr,
                    cfg.model.autocast_dtype,
                    world=world_size(),
                ),
                factor,
            )
        self.kl_controller = make_kl_controller(cfg.algo)
        self.loss_agg = cfg.algo.resolved_loss_agg
        self.is_cap = behaviour_is_cap(cfg.algo.old_logprobs, cfg.algo.tis_cap, cfg.pipeline.max_staleness)
        self.is_metric_names = is_weight_metric_names(cfg.pipeline.max_staleness)
        self.reward_normalizer = RunningMoments() if cfg.reward.normalize == "running" else None
        self._pre_step_grad_norms: dict[str, float] = {}
        self.update_count = 0
        self.extra_state: dict = {}
        if trainer_state_dir is not None:
            checkpoint.load_trainer_state(self, trainer_state_dir)

    def _autocast(self):
        return autocast(self.cfg.model.autocast_dtype, self.device)

    def _policy_forward(self, mb: ExperienceBatch, with_entropy: bool = False) -> PolicyOutput:
        with self._autocast():
            return policy_forward(
                self.actor,
                mb.prompt_ids,
                mb.prompt_mask,
                mb.response_ids,
                mb.response_mask,
                self.cfg.rollout.temperature,
                self.cfg.train.logprob_chunk,
                with_entropy=with_entropy,
                entropy_grad=self.cfg.algo.entropy_coef != 0,
            )

    def _critic_forward(self, mb: ExperienceBatch) -> torch.Tensor:
        with self._autocast():
            return critic_forward(self.critic, mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask)

    @property
    def device(self) -> torch.device:
        return next(self.actor.module.parameters()).device

    def save(self, out_dir: str, extra_state: Optional[dict] = None, optimizer_state: bool = True) -> dict[str, str]:
        """out_dir/policy (HF folder + tokenizer), out_dir/critic, out_dir/trainer (without the optimizer's files
        unless `optimizer_state`). See checkpoint.py.

        Returns {relative path: sha256} of the files hashed as they were written (checkpoint.save_trainer).
        """
        return checkpoint.save_trainer(self, out_dir, extra_state, optimizer_state)

    def actor_weights(self) -> Optional[dict[str, torch.Tensor]]:
        """The actor's state dict (its live tensors, not copies; with LoRA the merged weights) for a rollout
        engine in this process, or None under ZeRO-3, where a rank holds only its shard of each parameter."""
        if self.cfg.train.zero_stage == 3:
            return None
        if self.cfg.model.lora is not None:  # the base weights with the adapters merged in (new tensors for those)
            lora_cfg = self.cfg.model.lora
            return lora.merged_state_dict(self.actor.module.state_dict(), lora_cfg.alpha / lora_cfg.rank)
        return self.actor.module.state_dict()

    def save_policy(self, policy_dir: str) -> None:
        """Only the policy HF folder (for a rollout engine's weight refresh)."""
        checkpoint.save_policy(self, policy_dir)

    # -- stage 1: old log-probs and values -------------------------------------------------------------
    @torch.no_grad()
    def _old_logprobs_and_values(self, batch: ExperienceBatch) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(b, R) log-probs of the current actor and (b, R) critic values (None without a critic) of this rank's
        b rows, in micro-batches of train.micro_batch_size."""
        micro = self.cfg.train.micro_batch_size
        logprobs, values = [], []
        for start in range(0, len(batch), micro):
            mb = batch.select(torch.arange(start, min(start + micro, len(batch))))
            logprobs.append(self._policy_forward(mb).logprobs.float())
            if self.critic is not None:
                values.append(self._critic_forward(mb).float())
        return torch.cat(logprobs), (torch.cat(values) if values else None)

    @torch.no_grad()
    def _old_values(self, batch: ExperienceBatch) -> Optional[torch.Tensor]:
        """(b, R) critic values of this rank's b rows (None without a critic), in micro-batches: the old pass of
        algo.old_logprobs = rollout, which runs no actor forward."""
        if self.critic is None:
            return None
        micro = self.cfg.train.micro_batch_size
        values = [
            self._critic_forward(batch.select(torch.arange(start, min(start + micro, len(batch))))).float()
            for start in range(0, len(batch), micro)
        ]
        return torch.cat(values)

    @property
    def _old_from_rollout(self) -> bool:
        """algo.old_logprobs = rollout: the sampler's log-probs are the old ones, no actor forward before step 1."""
        return self.cfg.algo.old_logprobs == "rollout"

    def _old_from_first_forward(self, batch: ExperienceBatch) -> bool:
        """True when the first epoch is a single optimizer step over the whole batch whose share on each rank
        (this rank's rows `batch`, 1/world of the update batch) is a single micro-batch.

        Then its forward pass sees exactly the old weights, so a separate no-grad pass would compute the same
        log-probs and values again (one actor and one critic forward per update saved). The price: the
        actor's and the critic's graphs are alive together until the first backward (peak activation
        memory of both models instead of one).
        """
        return (
            len(batch) * self.actor.world_size == self.train_batch_size
            and self.actor.train_micro_batch_size_per_gpu() >= len(batch)
            and (self.critic is None or self.critic.train_micro_batch_size_per_gpu() >= len(batch))
        )

    def _first_forward(self, batch: ExperienceBatch) -> FirstForward:
        """The first epoch's forward over this rank's rows in order, with grad (see `_old_from_first_forward`)."""
        policy = self._policy_forward(batch, with_entropy=True)
        return FirstForward(policy, self._critic_forward(batch) if self.critic is not None else None)

    # -- stages 2-3: KL, token rewards, advantages -----------------------------------------------------
    def _advantages(self, batch: ExperienceBatch, old_logprobs, values, kl: torch.Tensor):
        algo = self.cfg.algo
        mask = batch.trained_mask  # multi-turn: environment tokens get no reward, KL or advantage (gae skips them)
        reward_kl_coef = self.kl_controller.value if algo.kl_in_reward else 0.0
        token_rewards = token_level_rewards(batch.scores, kl, mask, reward_kl_coef, self.cfg.reward.clip)
        group_size = batch.group_size if get_algorithm(algo.name).needs_groups else 1
        return ppo_advantages.compute_advantages(
            algo.name,
            scores=batch.scores,
            token_rewards=token_rewards,
            response_mask=mask,
            values=values,
            group_size=group_size,
            gamma=algo.gamma,
            lam=algo.lam,
            whiten=algo.whiten_advantages,
            reward_clip=self.cfg.reward.clip,
        )

    def _check_batch(self, batch: ExperienceBatch, total_rows: int) -> None:
        """`batch`: this rank's rows of an update batch of `total_rows` (every rank raises alike: same fields)."""
        if total_rows % self.train_batch_size:
            raise ValueError(
                f"update batch has {total_rows} samples, not a multiple of the train batch "
                f"{self.train_batch_size} (train.train_batch_size; a rollout that dropped groups for failed "
                f"environments has fewer rows: leave train.train_batch_size unset for one step per batch)"
            )
        if self._old_from_rollout and batch.rollout_logprobs is None:
            raise ValueError(
                "algo.old_logprobs='rollout' takes the sampler's log-probs as the old ones, but this batch has no "
                "rollout_logprobs (its scored shards carry none); use algo.old_logprobs=recompute"
            )
        if self.is_cap is not None and batch.rollout_logprobs is None:
            raise ValueError(
                "the importance weights (algo.tis_cap, pipeline.max_staleness) need the sampler's log-probs, "
                "but this batch has no rollout_logprobs"
            )
        batch.loss_mask(self.cfg.train.mask_truncated)  # raises when truncation is asked for but unknown

    def _shaped(self, batch: ExperienceBatch) -> tuple[ExperienceBatch, dict[str, float]]:
        """The batch with its scores shaped (reward.normalize, reward.overlong), and the shaping metrics."""
        overlong = self.cfg.reward.overlong
        scores, metrics = shape_scores(
            batch.scores,
            batch.response_mask,
            self.reward_normalizer,
            (overlong.buffer, overlong.penalty) if overlong is not None else None,
            self.cfg.rollout.max_new_tokens,
        )
        return dataclasses.replace(batch, scores=scores), metrics

    def update(self, batch: ExperienceBatch) -> UpdateResult:
        """One PPO update on `batch`, the whole update batch (every rank of a group passes the same one and
        keeps its rows of it, `rank_rows`). See `update_rows`."""
        world = self.actor.world_size
        if world > 1:
            start, stop = rank_rows(len(batch), self.actor.global_rank, world)
            batch = batch.select(torch.arange(start, stop))
        return self.update_rows(batch)

    def update_rows(self, own_rows: ExperienceBatch) -> UpdateResult:
        """One PPO update where `own_rows` are this rank's rows [r*B/N, (r+1)*B/N) of the update batch (rank_rows.py;
        with one rank, the whole batch). See the module docstring for the stages. Returns the metrics and the
        per-sample lists of ALL B rows (the same on every rank).

        Raises ValueError (on every rank alike) when the ranks hold different numbers of rows, when B is not a
        multiple of the train batch, or when the rows lack a field the config needs.
        """
        world = self.actor.world_size
        own_rows = own_rows.to(self.device)
        shape = agree_shape(own_rows, world)
        if self.cfg.train.train_batch_size is None:  # one step over the batch as it came: fewer rows than the
            self.train_batch_size = shape.rows  # rollout's when groups were dropped (stages/env_failures.py)
        self._check_batch(own_rows, shape.rows)
        pad_id = self.tokenizer.pad_token_id or 0  # as stages.tables.experience_batch pads
        local = pad_to(own_rows, shape.prompt_width, shape.response_width, pad_id)  # the widths one rank pads to
        old_logprobs, values, first_forward, mismatch, deferred = self._old_pass(local)
        raw, old_logprobs, values = gather_rows(local, old_logprobs, values, world)  # the whole batch from here
        batch, shaping_metrics = self._shaped(raw)
        mask = batch.trained_mask  # KL, advantages and metrics over the policy's own tokens (all, single-turn)
        # deferred (first_step_old.py): the first step's rows get their old log-probs in that step; the token
        # rewards hold no KL then (algo.kl_in_reward false), so the advantages take none
        kl = torch.zeros_like(old_logprobs) if deferred else self._kl(batch, old_logprobs)
        adv = self._advantages(batch, old_logprobs, values, kl)
        sums = self._epochs(batch, old_logprobs, values, adv, first_forward, deferred)
        if deferred:  # old_logprobs is whole now
            kl, mismatch = self._kl(batch, old_logprobs), start_mismatch(self, local, old_logprobs, None)
        kl_mean = float(masked_mean(kl, mask))
        kl_per_sequence = float(masked_sum(kl, mask, dim=-1).mean())
        metrics = batch_metrics(raw, old_logprobs, values, adv, kl_mean, float(self.kl_controller.value))
        if not self._old_from_rollout:  # (with the sampler's log-probs as the old ones there is nothing to measure)
            metrics.update(sampler_gap_metric(raw, old_logprobs))
        metrics.update(signal_metrics(batch.scores, batch.group_ids.tolist(), adv.advantages, mask))
        metrics.update(shaping_metrics)
        metrics["kl/sequence_mean"] = kl_per_sequence
        metrics.update(sums.means())
        metrics.update(mismatch if mismatch is not None else first_step_mismatch(self))
        # Per sequence, not per token: a target of 6 nats means 6 nats per response, as in the paper (a
        # per-token mean would be ~length times smaller and drive beta down for as long as the run lasts).
        self.kl_controller.update(kl_per_sequence, len(batch))
        self.update_count += 1
        return UpdateResult(
            metrics,
            # every response token's, environment tokens' too (their advantages and returns are 0)
            ragged(old_logprobs, batch.response_mask),
            ragged(values, batch.response_mask) if values is not None else [[] for _ in range(len(batch))],
            ragged(adv.advantages, batch.response_mask),
            ragged(adv.returns, batch.response_mask),
        )

    def _kl(self, batch: ExperienceBatch, old_logprobs: torch.Tensor) -> torch.Tensor:
        """(B, R) per-token KL of the old log-probs to the reference's (algo.kl_estimator)."""
        return kl_penalty(old_logprobs, batch.ref_logprobs, self.cfg.algo.kl_estimator, KL_CLAMP)

    def _old_pass(self, local: ExperienceBatch):
        """Stage 1 on this rank's padded rows, before any weight moves: (old log-probs [b, R], old values [b, R] or
        None, [the first epoch's own forward] when it stands in for the pass (a FirstForward in a list, which
        `_epochs` empties: no reference outlives its step) or [], the sampler-vs-trainer mismatch metrics or None:
        engines/trainer/mismatch.py, deferred: True when the first step fills its rows (first_step_old.py))."""
        single = self._old_from_first_forward(local)
        if not single and defers_old(self):
            self.first_step_mismatch = None  # measured after the steps, from the whole old log-probs
            return old_except(self, local, first_step_rows(self, local.group_ids)), None, [], None, True
        first = self._first_forward(local) if single else None
        old_logprobs = None
        if first is not None:
            old_logprobs = first.policy.logprobs.detach().float()
            values = first.values.detach().float() if first.values is not None else None
        elif self._old_from_rollout:
            values = self._old_values(local)  # the old log-probs are the sampler's, taken below
        else:
            old_logprobs, values = self._old_logprobs_and_values(local)
        mismatch = start_mismatch(self, local, old_logprobs, first)
        if self._old_from_rollout:  # the sampler's log-probs (0 at padding, as the actor's are masked there)
            old_logprobs = local.rollout_logprobs.float()
        return old_logprobs, values, [first] if first is not None else [], mismatch, False

    def _epochs(
        self, batch: ExperienceBatch, old_logprobs, values, adv, first_forward: list[FirstForward], deferred=False
    ) -> MetricSums:
        """Stage 4: algo.ppo_epochs passes of shuffled optimizer steps over the whole batch; their loss sums.
        deferred: epoch 0's first step fills its rows of old_logprobs from its own forwards (first_step_old.py)."""
        first = first_forward.pop() if first_forward else None
        sums = MetricSums()
        for epoch in range(self.cfg.train.ppo_epochs):
            if first is not None and epoch == 0:
                # the one step of epoch 0 reuses the forward taken above (rows in batch order: with a single
                # step the order changes nothing but the summation order; each rank's share is its own rows)
                rows = torch.arange(len(batch), device=self.device)
                self._optimizer_step(batch, rows, old_logprobs, values, adv, sums, first)
                first = None  # frees both graphs' references before the next epoch
                continue
            order = self._epoch_order(epoch, batch.group_ids)
            for start in range(0, len(batch), self.train_batch_size):
                rows = order[start : start + self.train_batch_size].to(self.device)
                fill_old = deferred and epoch == 0 and start == 0
                self._optimizer_step(batch, rows, old_logprobs, values, adv, sums, fill_old=fill_old)
        return sums

    def _epoch_order(self, epoch: int, group_ids: torch.Tensor) -> torch.Tensor:
        """(B,) the order in which epoch `epoch` of this update visits the rows (epoch_order.py)."""
        return epoch_order(self.cfg.run.seed, self.update_count, epoch, group_ids, self.cfg.train.shuffle)
