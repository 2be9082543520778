"""Reference log-probs: the frozen initial policy scores each response token for the KL penalty.

The reference is scored at the sampling temperature, like the actor, so that log pi / T and log pi_ref / T
are comparable (OpenRLHF and veRL do the same).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional

import torch

from engines.models import autocast, load_reference, precast_linear_weights, weight_files
from engines.scoring.file_weights import map_to_files
from engines.trainer.experience import left_pad, right_pad
from engines.trainer.forward import policy_forward
from ppoflow.fingerprint import folder_fingerprint


def weights_fingerprint(model_dir: str | Path) -> str:
    """The folder's *.safetensors contents as one fingerprint (ppoflow/fingerprint.py): changes whenever the
    weights do. Reads every weight byte once per process (about 20 s for 14 GB); FileNotFoundError without
    weights."""
    if not weight_files(model_dir):
        raise FileNotFoundError(f"no *.safetensors weights in {str(model_dir)!r}")
    return folder_fingerprint(model_dir, "*.safetensors")[:16]


def _reference_fingerprint(path: str, dtype: str, autocast_dtype: Optional[str]) -> str:
    """Part of the score cache's key: the weights, and the precision when it is not the default (log-probs
    computed at another precision are other numbers; float32 keeps the bare weights fingerprint, so older
    caches stay valid)."""
    precision = "" if (dtype, autocast_dtype) == ("float32", None) else f"-{dtype}-autocast-{autocast_dtype}"
    return weights_fingerprint(path) + precision


@contextlib.contextmanager
def _base_only(peft_model):
    """peft_model scores as its frozen base: adapters disabled, eval mode; both restored afterwards."""
    was_training = peft_model.training
    peft_model.eval()
    try:
        with peft_model.disable_adapter():
            yield
    finally:
        peft_model.train(was_training)


class ReferenceModel:
    """Frozen reference policy. `logprobs` returns one list of floats per response (ragged)."""

    def __init__(
        self,
        path: str,
        dtype: str = "float32",
        temperature: float = 1.0,
        micro_batch_size: int = 16,
        attn_implementation: str = "sdpa",
        device: str = "cpu",
        chunk_size: int = 256,
        autocast_dtype: Optional[str] = None,
    ):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.path = str(path)
        self.model = load_reference(path, dtype, attn_implementation).to(device)
        precast_linear_weights(self.model, autocast_dtype)  # frozen: cast once, not per forward
        # the weights as pages of their files, dropped from this process between scores (file_weights.py)
        self._mapped = map_to_files(self.model, path) if device == "cpu" else None
        self._users = 0  # nested in_use() blocks
        self.device = torch.device(device)
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size
        self.chunk_size = chunk_size
        self.pad_token_id = self.model.config.pad_token_id or 0
        self.autocast_dtype = autocast_dtype
        self.fingerprint = _reference_fingerprint(path, dtype, autocast_dtype)
        self._adapter_off = contextlib.nullcontext  # a shared LoRA base: peft's disable_adapter (shared_base)

    @classmethod
    def shared_base(
        cls,
        peft_model,
        path: str,
        dtype: str = "float32",
        temperature: float = 1.0,
        micro_batch_size: int = 16,
        chunk_size: int = 256,
        autocast_dtype: Optional[str] = None,
    ) -> "ReferenceModel":
        """The reference as a LoRA actor's frozen base, in the trainer's process: the actor's own module scored
        inside peft's `disable_adapter()` (and eval mode), so no second copy of the weights is loaded.

        Valid because LoRA never changes the base weights: with adapters off the module computes the initial
        policy `path` (model.policy_path), whose fingerprint keys the score cache exactly as a loaded reference
        would. Its weights are not precast (they belong to a trainer). Not thread-safe against a concurrent
        training step on the same module (the adapters are off while it scores).
        """
        ref = cls.__new__(cls)
        ref.path, ref.model, ref.device = str(path), peft_model, next(peft_model.parameters()).device
        ref.temperature, ref.micro_batch_size, ref.chunk_size = temperature, micro_batch_size, chunk_size
        ref.pad_token_id = peft_model.config.pad_token_id or 0
        ref.autocast_dtype = autocast_dtype
        ref.fingerprint = _reference_fingerprint(path, dtype, autocast_dtype)
        ref._adapter_off = lambda: _base_only(peft_model)
        ref._mapped, ref._users = None, 0  # the trainer's own weights: nothing to drop
        return ref

    @torch.no_grad()
    def logprobs(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        """log pi_ref(token) / T for every response token. Shape: ragged (B, response_len_b).

        Raises ValueError when the two lists differ in length or a prompt is empty.
        """
        if len(prompt_ids) != len(response_ids):
            raise ValueError(f"{len(prompt_ids)} prompts but {len(response_ids)} responses")
        for index, p in enumerate(prompt_ids):
            if not p:
                raise ValueError(f"sample {index}: empty prompt")
        result: list[list[float]] = []
        with self.in_use():
            for start in range(0, len(prompt_ids), self.micro_batch_size):
                prompts = prompt_ids[start : start + self.micro_batch_size]
                responses = response_ids[start : start + self.micro_batch_size]
                result.extend(self._micro_batch(prompts, responses))
        return result

    @contextlib.contextmanager
    def in_use(self):
        """Keep the weights' pages in this process across the `logprobs` calls inside (a scorer's micro-batches);
        the outermost exit drops them (file_weights.py), so the next score faults them in again once."""
        self._users += 1
        try:
            yield self
        finally:
            self._users -= 1
            if not self._users and self._mapped is not None:
                self._mapped.release()

    def _micro_batch(self, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
        width_r = max(1, max(len(r) for r in responses))
        prompt, prompt_mask = left_pad(prompts, max(len(p) for p in prompts), self.pad_token_id)
        response = right_pad(responses, width_r, self.pad_token_id, torch.long)
        response_mask = right_pad([[1] * len(r) for r in responses], width_r, 0, torch.long)
        with self._adapter_off(), autocast(self.autocast_dtype, self.device):
            out = policy_forward(
                self.model,
                prompt.to(self.device),
                prompt_mask.to(self.device),
                response.to(self.device),
                response_mask.to(self.device),
                self.temperature,
                self.chunk_size,
            )
        logprobs = out.logprobs.float().cpu()
        return [logprobs[b, : len(r)].tolist() for b, r in enumerate(responses)]
