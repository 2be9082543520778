"""PPOTrainer: one PPO update of the actor (and the critic for algo "ppo") with DeepSpeed.

An update reads as its stages in order:
  1. old log-probs (actor) and old values (critic), no grad, in micro-batches -- or, when the whole batch
     is one optimizer step of one micro-batch (the common single-minibatch recipe), taken from the first
     epoch's own forward pass, which runs before any weight moves (see `_first_forward`);
  2. the scalar reward shaped (engines.ppo.reward_shaping: reward.normalize, then reward.overlong);
     per-token KL to the reference (algo.kl_estimator); token rewards (KL folded in when algo.kl_in_reward);
  3. advantages and returns (engines.ppo.compute_advantages, the estimator of algo.name's registry entry);
  4. algo.ppo_epochs passes; each shuffles the rows (seeded by run.seed and the update count, so a resumed
     run shuffles exactly like an uninterrupted one) and cuts them into optimizer steps of
     train.train_batch_size rows, each accumulated over micro-batches of train.micro_batch_size;
  5. the KL controller sees the batch's mean KL per sequence (each response's KL summed over its tokens,
     averaged over responses: the unit of Ziegler et al.'s target, `algo.kl_target`).

Loss scale: every micro-batch loss is aggregated (algo.loss_agg, engines/ppo/algorithms.py) with the
denominators of its whole optimizer step (`losses.step_norm`: the step's response tokens, responses, and
Dr. GRPO's constant) and DeepSpeed's own 1/accumulation scaling is switched off (`scale_wrt_gas=False`), so
the accumulated gradient is the gradient of the step's aggregated loss however the step is split.
Several data-parallel ranks (one DeepSpeed world started by a launcher): every rank holds the whole batch
(old log-probs and advantages are computed on all of it, so group baselines and whitening see every row),
trains on its share
rows[rank::world] of each step, and aggregates with the WHOLE step's denominators; DeepSpeed averages the
ranks' gradients, so each rank's loss is multiplied by the world size: the step's gradient is then the
gradient of the token mean over all tokens of the step on all ranks, as with one rank.
The loss mask is the response mask, without truncated samples when train.mask_truncated is on; with
algo.tis_cap, or with pipelined iterations (pipeline.max_staleness >= 1), the policy-gradient tokens carry truncated
importance weights pi_old / pi_sampler (decoupled PPO: engines/ppo/off_policy.py).

Grad norms: `optim/*_grad_norm` is the pre-clip global norm of the step's gradient. ZeRO stages 1-3 report
it (DeepSpeed's optimizer computes it to clip); at stage 0 DeepSpeed clips without keeping it, so the
trainer computes it from the accumulated .grad tensors just before the step.

Precision: model.autocast_dtype ("bfloat16") runs every actor/critic forward (and so its backward) under
torch.autocast; weights, gradients and AdamW state stay float32, log-probs and values come out float32.

Checkpoints: see engines/trainer/checkpoint.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Optional

import torch

from engines.models import autocast, load_critic, load_tokenizer
from engines.ppo import advantages as ppo_advantages
from engines.ppo.algorithms import get_algorithm
from engines.ppo.kl import kl_penalty
from engines.ppo.kl_controller import make_kl_controller
from engines.ppo.losses import StepNorm, entropy_loss, kl_loss, policy_loss, step_norm, truncated_is_weights, value_loss
from engines.ppo.masked import masked_mean, masked_sum
from engines.ppo.off_policy import behaviour_is_cap, is_weight_metric_names
from engines.ppo.reward_norm import RunningMoments
from engines.ppo.reward_shaping import shape_scores
from engines.ppo.rewards import token_level_rewards
from engines.trainer import checkpoint, lora
from engines.trainer.deepspeed_setup import (
    deepspeed_config,
    lr_multiplier,
    make_engine,
    setup_distributed,
    sum_over_ranks,
)
from engines.trainer.experience import ExperienceBatch
from engines.trainer.forward import PolicyOutput, critic_forward, policy_forward

KL_CLAMP = 10.0  # log-ratio clamp for every KL estimate (see engines.ppo.kl)


@dataclass
class UpdateResult:
    """metrics: namespaced floats. The lists are per sample, each of its response length (no padding)."""

    metrics: dict[str, float]
    old_logprobs: list[list[float]]
    values: list[list[float]]
    advantages: list[list[float]]
    returns: list[list[float]]


@dataclass
class _FirstForward:
    """The first epoch's forward over the whole batch, graphs kept: policy (B, R) log-probs (+ entropy) and
    critic values (B, R) or None. Its detached outputs are the update's old log-probs and values."""

    policy: PolicyOutput
    values: Optional[torch.Tensor]


@dataclass
class _Sums:
    """Token-weighted sums of micro-batch metrics over an update."""

    totals: dict[str, float] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)

    def add(self, key: str, value, weight: float = 1.0) -> None:
        self.totals[key] = self.totals.get(key, 0.0) + float(value) * weight
        self.weights[key] = self.weights.get(key, 0.0) + weight

    def means(self) -> dict[str, float]:
        return {k: self.totals[k] / self.weights[k] for k in self.totals if self.weights[k] > 0}


@torch.no_grad()
def _grad_norm(module: torch.nn.Module) -> Optional[float]:
    """Global 2-norm of the module's .grad tensors (what clip_grad_norm_ measures before clipping); None when
    no parameter holds a gradient (nothing was measured)."""
    norms = [p.grad.detach().float().norm() for p in module.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else None


def _ragged(tensor: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    """(B, R) values of right-padded rows -> each row's first mask.sum() values (one tolist, not one per row)."""
    lengths = mask.sum(dim=1).long().tolist()
    return [row[:n] for row, n in zip(tensor.tolist(), lengths)]


class PPOTrainer:
    """Actor (and critic) as DeepSpeed engines. `trainer_state_dir` resumes optimizer/scheduler/KL/RNG."""

    def __init__(self, cfg, policy_dir: str, critic_dir: Optional[str] = None, trainer_state_dir: Optional[str] = None):
        setup_distributed()
        if trainer_state_dir is None:
            # A fresh trainer draws new parameters (the critic's value head): seed them from the run, not
            # from whatever the process did before, so a rebuilt run equals an uninterrupted one. A resumed
            # trainer restores its RNG states from the checkpoint instead.
            torch.manual_seed(cfg.run.seed)
        self.cfg = cfg
        self.policy_dir = str(policy_dir)
        self.tokenizer = load_tokenizer(policy_dir)
        self.train_batch_size = cfg.train.train_batch_size or cfg.rollout_batch_size
        steps_per_update = cfg.train.ppo_epochs * (cfg.rollout_batch_size // self.train_batch_size)
        factor = lr_multiplier(cfg.train.warmup_steps, cfg.run.iterations * steps_per_update, cfg.train.lr_schedule)
        policy = lora.load_actor(cfg, policy_dir)  # with gradient checkpointing / LoRA as configured
        self.actor = make_engine(
            policy, deepspeed_config(cfg.train, cfg.model.dtype, self.train_batch_size, cfg.train.actor_lr), factor
        )
        self.critic = None
        if cfg.algo.uses_critic:
            critic = load_critic(
                critic_dir or cfg.model.critic_path or policy_dir, cfg.model.dtype, cfg.model.attn_implementation
            )
            if cfg.model.gradient_checkpointing:
                critic.gradient_checkpointing_enable()
            self.critic = make_engine(
                critic, deepspeed_config(cfg.train, cfg.model.dtype, self.train_batch_size, cfg.train.critic_lr), factor
            )
        self.kl_controller = make_kl_controller(cfg.algo)
        self.loss_agg = cfg.algo.resolved_loss_agg
        self.is_cap = behaviour_is_cap(cfg)
        self.is_metric_names = is_weight_metric_names(cfg)
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

    def save(self, out_dir: str, extra_state: Optional[dict] = None) -> dict[str, str]:
        """out_dir/policy (HF folder + tokenizer), out_dir/critic, out_dir/trainer. See checkpoint.py.

        Returns {relative path: sha256} of the files hashed as they were written (checkpoint.save_trainer).
        """
        return checkpoint.save_trainer(self, out_dir, extra_state)

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
        """(B, R) log-probs of the current actor and (B, R) critic values (None without a critic)."""
        micro = self.cfg.train.micro_batch_size
        logprobs, values = [], []
        for start in range(0, len(batch), micro):
            mb = batch.select(torch.arange(start, min(start + micro, len(batch))))
            logprobs.append(self._policy_forward(mb).logprobs.float())
            if self.critic is not None:
                values.append(self._critic_forward(mb).float())
        return torch.cat(logprobs), (torch.cat(values) if values else None)

    def _old_from_first_forward(self, batch: ExperienceBatch) -> bool:
        """True when the first epoch is a single optimizer step of a single micro-batch over the whole batch.

        Then its forward pass sees exactly the old weights, so a separate no-grad pass would compute the same
        log-probs and values again (one actor and one critic forward per update saved). The price: the
        actor's and the critic's graphs are alive together until the first backward (peak activation
        memory of both models instead of one).
        """
        return (
            len(batch) == self.train_batch_size
            and self.actor.train_micro_batch_size_per_gpu() >= len(batch)
            and (self.critic is None or self.critic.train_micro_batch_size_per_gpu() >= len(batch))
        )

    def _first_forward(self, batch: ExperienceBatch) -> _FirstForward:
        """The first epoch's forward over all rows in batch order, with grad (see `_old_from_first_forward`)."""
        policy = self._policy_forward(batch, with_entropy=True)
        return _FirstForward(policy, self._critic_forward(batch) if self.critic is not None else None)

    # -- stages 2-3: KL, token rewards, advantages -----------------------------------------------------
    def _advantages(self, batch: ExperienceBatch, old_logprobs, values, kl: torch.Tensor):
        algo = self.cfg.algo
        mask = batch.response_mask
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

    def _check_batch(self, batch: ExperienceBatch) -> None:
        if len(batch) % self.train_batch_size:
            raise ValueError(
                f"update batch has {len(batch)} samples, not a multiple of the train batch "
                f"{self.train_batch_size} (train.train_batch_size)"
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
        """One PPO update on `batch` (see the module docstring for the stages). Returns metrics and per-sample lists."""
        self._check_batch(batch)
        raw = batch.to(self.device)
        batch, shaping_metrics = self._shaped(raw)
        mask = batch.response_mask
        first = self._first_forward(batch) if self._old_from_first_forward(batch) else None
        if first is not None:
            old_logprobs = first.policy.logprobs.detach().float()
            values = first.values.detach().float() if first.values is not None else None
        else:
            old_logprobs, values = self._old_logprobs_and_values(batch)
        kl = kl_penalty(old_logprobs, batch.ref_logprobs, self.cfg.algo.kl_estimator, KL_CLAMP)
        adv = self._advantages(batch, old_logprobs, values, kl)
        sums = _Sums()
        for epoch in range(self.cfg.train.ppo_epochs):
            if first is not None and epoch == 0:
                # the one step of epoch 0 reuses the forward taken above (rows in batch order: with a single
                # step the order changes nothing but the summation order)
                rows = torch.arange(len(batch), device=self.device)
                self._optimizer_step(batch, rows, old_logprobs, values, adv, sums, first)
                first = None  # frees both graphs' references before the next epoch
                continue
            order = torch.randperm(len(batch), generator=self._shuffle_generator(epoch))
            for start in range(0, len(batch), self.train_batch_size):
                rows = order[start : start + self.train_batch_size].to(self.device)
                self._optimizer_step(batch, rows, old_logprobs, values, adv, sums)
        kl_mean = float(masked_mean(kl, mask))
        kl_per_sequence = float(masked_sum(kl, mask, dim=-1).mean())
        metrics = self._batch_metrics(raw, old_logprobs, values, adv, kl_mean)
        metrics.update(shaping_metrics)
        metrics["kl/sequence_mean"] = kl_per_sequence
        metrics.update(sums.means())
        # Per sequence, not per token: a target of 6 nats means 6 nats per response, as in the paper (a
        # per-token mean would be ~length times smaller and drive beta down for as long as the run lasts).
        self.kl_controller.update(kl_per_sequence, len(batch))
        self.update_count += 1
        return UpdateResult(
            metrics,
            _ragged(old_logprobs, mask),
            _ragged(values, mask) if values is not None else [[] for _ in range(len(batch))],
            _ragged(adv.advantages, mask),
            _ragged(adv.returns, mask),
        )

    def _shuffle_generator(self, epoch: int) -> torch.Generator:
        digest = hashlib.sha256(f"{self.cfg.run.seed}:{self.update_count}:{epoch}".encode()).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)

    # -- stage 4: one optimizer step, accumulated over micro-batches -----------------------------------
    def _optimizer_step(
        self, batch, rows, old_logprobs, values, adv, sums: _Sums, first: Optional[_FirstForward] = None
    ) -> None:
        """One optimizer step over `rows`; `first` (only with rows = the whole batch in order, one micro-batch)
        supplies the forward outputs instead of new forward passes."""
        micro = self.actor.train_micro_batch_size_per_gpu()
        mask_truncated = self.cfg.train.mask_truncated
        norm = step_norm(batch.select(rows).loss_mask(mask_truncated), self.cfg.loss_agg_norm)  # the whole step's
        rows = rows[self.actor.global_rank :: self.actor.world_size]  # this rank's share (module docstring)
        step_losses = {"loss/policy": 0.0, "loss/value": 0.0}
        for start in range(0, len(rows), micro):
            r = rows[start : start + micro]
            mb = batch.select(r)
            loss_mask = mb.loss_mask(mask_truncated)
            step_losses["loss/policy"] += self._actor_micro_step(
                mb,
                loss_mask,
                old_logprobs[r],
                adv.advantages[r],
                norm,
                sums,
                first.policy if first is not None else None,
            )
            if self.critic is not None:
                step_losses["loss/value"] += self._critic_micro_step(
                    mb, loss_mask, values[r], adv.returns[r], norm, sums, first.values if first is not None else None
                )
        # The step's loss is the sum of its micro-batch shares (each aggregated with the step's denominators),
        # over all ranks.
        step_losses = sum_over_ranks(step_losses, self.actor.world_size)
        sums.add("loss/policy", step_losses["loss/policy"])
        self._add_optim_metrics("actor", self.actor, sums)
        if self.critic is not None:
            sums.add("loss/value", step_losses["loss/value"])
            self._add_optim_metrics("critic", self.critic, sums)

    def _engine_step(self, role: str, engine) -> None:
        """engine.step(); at ZeRO stage 0, first record the pre-clip grad norm DeepSpeed will not keep."""
        if engine.zero_optimization_stage() == 0 and engine.is_gradient_accumulation_boundary():
            norm = _grad_norm(engine.module)
            if norm is not None:
                self._pre_step_grad_norms[role] = norm
        engine.step()

    def _add_optim_metrics(self, role: str, engine, sums: _Sums) -> None:
        """optim/<role>_grad_norm (left out when DeepSpeed kept no norm) and optim/<role>_lr after a step."""
        if engine.zero_optimization_stage() == 0:
            norm = self._pre_step_grad_norms.pop(role, None)
        else:
            norm = engine.get_global_grad_norm()
        if norm is not None:
            sums.add(f"optim/{role}_grad_norm", float(norm))
        sums.add(f"optim/{role}_lr", engine.get_lr()[0])

    def _actor_micro_step(
        self,
        mb: ExperienceBatch,
        loss_mask,
        old_logprobs,
        advantages,
        norm: StepNorm,
        sums,
        out: Optional[PolicyOutput] = None,
    ) -> float:
        """Loss, backward and (at the step's boundary) optimizer step; `out`: this micro-batch's forward, taken
        already. loss_mask (b, R): 1 = the token counts. Returns this micro-batch's share of the step's loss."""
        algo = self.cfg.algo
        if out is None:
            out = self._policy_forward(mb, with_entropy=True)
        agg = dict(agg_mode=self.loss_agg, num_tokens=norm.num_tokens, num_seqs=norm.num_seqs, max_len=norm.max_len)
        weight = float(loss_mask.sum())
        tis_weights = None
        if self.is_cap is not None:
            tis_weights, tis_mean, tis_clipfrac = truncated_is_weights(
                old_logprobs, mb.rollout_logprobs, loss_mask, self.is_cap
            )
            mean_name, clipfrac_name = self.is_metric_names
            sums.add(mean_name, tis_mean, weight)
            sums.add(clipfrac_name, tis_clipfrac, weight)
        pl = policy_loss(
            out.logprobs,
            old_logprobs,
            advantages,
            loss_mask,
            algo.clip_low,
            algo.clip_high,
            algo.dual_clip,
            token_weights=tis_weights,
            **agg,
        )
        loss = pl.loss
        if algo.entropy_coef != 0:
            loss = loss + algo.entropy_coef * entropy_loss(out.entropy, loss_mask, **agg)
        if not algo.kl_in_reward and self.kl_controller.value > 0:
            loss = loss + self.kl_controller.value * kl_loss(
                out.logprobs, mb.ref_logprobs, loss_mask, algo.kl_estimator, KL_CLAMP, **agg
            )
        self.actor.backward(loss * self.actor.world_size, scale_wrt_gas=False)  # undo DeepSpeed's rank average
        self._engine_step("actor", self.actor)
        if weight > 0:  # a micro-batch of masked samples only has no tokens to average diagnostics over
            sums.add("policy/clipfrac", pl.clipfrac, weight)
            sums.add("policy/approx_kl", pl.approx_kl, weight)
            sums.add("policy/ratio_mean", pl.ratio_mean, weight)
            sums.add("policy/entropy", masked_mean(out.entropy.detach(), loss_mask), weight)
        return float(loss.detach())

    def _critic_micro_step(
        self,
        mb: ExperienceBatch,
        loss_mask,
        old_values,
        returns,
        norm: StepNorm,
        sums,
        values: Optional[torch.Tensor] = None,
    ) -> float:
        if values is None:
            values = self._critic_forward(mb)
        vl = value_loss(
            values,
            old_values,
            returns,
            loss_mask,
            self.cfg.algo.value_clip,
            agg_mode=self.loss_agg,
            num_tokens=norm.num_tokens,
            num_seqs=norm.num_seqs,
            max_len=norm.max_len,
        )
        self.critic.backward(vl.loss * self.critic.world_size, scale_wrt_gas=False)
        self._engine_step("critic", self.critic)
        weight = float(loss_mask.sum())
        if self.cfg.algo.value_clip is not None and weight > 0:  # without a clip there is no clip fraction
            sums.add("value/clipfrac", vl.clipfrac, weight)
        return float(vl.loss.detach())

    def _batch_metrics(self, batch, old_logprobs, values, adv, kl_mean: float) -> dict[str, float]:
        mask = batch.response_mask
        metrics = {
            "reward/mean": float(batch.scores.mean()),
            "kl/mean": kl_mean,
            "kl/coef": float(self.kl_controller.value),
            "response/length_mean": float(mask.sum(dim=1).mean()),
            "advantages/mean": float(masked_mean(adv.advantages, mask)),
            "returns/mean": float(masked_mean(adv.returns, mask)),
        }
        if len(batch) > 1:  # one sample has no spread (std would be NaN; 0 would be made up)
            metrics["reward/std"] = float(batch.scores.std())
        if batch.rollout_logprobs is not None:
            # How far the sampler's log-probs are from the trainer's for the same weights (should be ~0).
            metrics["rollout/logprob_abs_diff"] = float(
                masked_mean((batch.rollout_logprobs - old_logprobs).abs(), mask)
            )
        if batch.truncated is not None:
            metrics["response/truncated_fraction"] = float(batch.truncated.float().mean())
        if values is not None:
            metrics["values/mean"] = float(masked_mean(values, mask))
        return metrics
