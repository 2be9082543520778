"""The loss side of a PPO update: one optimizer step over a set of rows, accumulated over micro-batches.

    LossSteps._optimizer_step(batch, rows, ...)   this rank's share of the step's rows (rank_rows.step_share),
                                                  cut into micro-batches; loss, backward, DeepSpeed step
    LossSteps._actor_micro_step / _critic_micro_step   one micro-batch's clipped policy / value loss

PPOTrainer (ppo_trainer.py) inherits these: it prepares the experience (old log-probs, values, advantages)
and calls `_optimizer_step` once per step. Loss scale: every micro-batch loss is aggregated (algo.loss_agg)
with the denominators of its WHOLE optimizer step over all ranks (`losses.step_norm`: the step's response
tokens, responses, and Dr. GRPO's constant), and DeepSpeed's own 1/accumulation scaling is switched off
(`scale_wrt_gas=False`), so the accumulated gradient is the gradient of the step's aggregated loss however
the step is split. DeepSpeed averages the ranks' gradients, so each rank's loss is multiplied by the world
size: the step's gradient is then the gradient of the token mean over all tokens of the step on all ranks.

Grad norms: `optim/*_grad_norm` is the pre-clip global norm of the step's gradient. ZeRO stages 1-3 report
it (DeepSpeed's optimizer computes it to clip); at stage 0 DeepSpeed clips without keeping it, so the
trainer computes it from the accumulated .grad tensors just before the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from engines.ppo.losses import StepNorm, entropy_loss, kl_loss, policy_loss, step_norm, truncated_is_weights, value_loss
from engines.ppo.masked import masked_mean
from engines.ppo.mismatch import MismatchSums, mismatch_sums
from engines.trainer.deepspeed_setup import sum_over_ranks
from engines.trainer.experience import ExperienceBatch
from engines.trainer.forward import PolicyOutput
from engines.trainer.rank_rows import step_share

KL_CLAMP = 10.0  # log-ratio clamp for every KL estimate (see engines.ppo.kl)


@dataclass
class FirstForward:
    """The first epoch's forward over this rank's rows, graphs kept: policy (b, R) log-probs (+ entropy) and
    critic values (b, R) or None. Its detached outputs are the update's old log-probs and values."""

    policy: PolicyOutput
    values: Optional[torch.Tensor]


@dataclass
class MetricSums:
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


class LossSteps:
    """The optimizer step and its micro-steps; mixed into PPOTrainer, which sets actor, critic, cfg, loss_agg,
    is_cap, is_metric_names, kl_controller and _pre_step_grad_norms, and defines _policy_forward / _critic_forward."""

    # Armed (a list) by engines/trainer/mismatch.py when the sampler-vs-trainer gap is taken from the update's first
    # step: each actor micro-step of that step adds its MismatchSums, and the step's end moves them to first_step_sums.
    first_step_mismatch: Optional[list[MismatchSums]] = None
    first_step_sums: tuple[MismatchSums, ...] | list[MismatchSums] = ()

    def _optimizer_step(
        self,
        batch,
        rows,
        old_logprobs,
        values,
        adv,
        sums: MetricSums,
        first: Optional[FirstForward] = None,
        fill_old: bool = False,
    ) -> None:
        """One optimizer step over `rows` (S,), indices into the whole update batch `batch` (B, ...) and its
        (B, R) old_logprobs, values and advantages; this rank trains on its share (`step_share`). `first` (only
        with rows = arange(B), one micro-batch per rank) is this rank's forward over its share, taken already.
        fill_old (the update's first step, no weight moved yet: first_step_old.py): each micro-batch writes its
        forward's detached log-probs into old_logprobs[rows] (in place) before its loss reads them."""
        micro = self.actor.train_micro_batch_size_per_gpu()
        mask_truncated = self.cfg.train.mask_truncated
        norm = step_norm(batch.select(rows).loss_mask(mask_truncated), self.cfg.loss_agg_norm)  # the whole step's
        # In batch order, a group's samples sit side by side in the micro-batches, so each micro-batch's forward
        # runs fewer distinct prompts (forward.py, shared_prompt.py). Which rows make the step is unchanged, and
        # its loss is over the whole step's denominators: how it is cut changes only the summation order.
        rows = rows.sort().values
        rows = step_share(rows, self.actor.global_rank, self.actor.world_size)  # this rank's share
        step_losses = {"loss/policy": 0.0, "loss/value": 0.0}
        for start in range(0, len(rows), micro):
            r = rows[start : start + micro]
            mb = batch.select(r)
            loss_mask = mb.loss_mask(mask_truncated)
            out = first.policy if first is not None else None
            if fill_old:
                out = self._policy_forward(mb, with_entropy=True)
                old_logprobs[r] = out.logprobs.detach().float()
            step_losses["loss/policy"] += self._actor_micro_step(
                mb, loss_mask, old_logprobs[r], adv.advantages[r], norm, sums, out
            )
            if self.critic is not None:
                step_losses["loss/value"] += self._critic_micro_step(
                    mb, loss_mask, values[r], adv.returns[r], norm, sums, first.values if first is not None else None
                )
        # The step's loss is the sum of its micro-batch shares (each aggregated with the step's denominators),
        # over all ranks.
        step_losses = sum_over_ranks(step_losses, self.actor.world_size)
        if self.first_step_mismatch is not None:  # measured: later steps run moved weights
            self.first_step_sums, self.first_step_mismatch = self.first_step_mismatch, None
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

    def _add_optim_metrics(self, role: str, engine, sums: MetricSums) -> None:
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
        if self.first_step_mismatch is not None:  # the update's first step: the sampler's weights (mismatch.py)
            self.first_step_mismatch.append(mismatch_sums(mb.rollout_logprobs, out.logprobs.detach(), mb.trained_mask))
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
