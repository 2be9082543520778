"""Loading the models of a PPO run: tokenizer, policy (actor), critic (value head) and frozen reference.

Every model comes from a local Hugging Face folder through the real `from_pretrained` path, so a tiny toy
model and a real checkpoint take the same code. Precision (`dtype`: float32 on CPU, bfloat16 on GPU) and
the attention kernel (`attn_implementation`, SDPA by default) are settings from `ModelConfig`.

The critic is `ValueHeadModel`: the causal-LM backbone without its LM head (`AutoModel`) plus a linear
value head (hidden -> 1). It is initialised either from the policy folder (new head) or from a reward-model
folder (`*ForSequenceClassification` with one label: its `score` head initialises the value head when the
shapes fit). A saved critic is a folder with the backbone (`save_pretrained`: config.json + safetensors),
`value_head.safetensors` and `critic.json`; no pickle anywhere.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Optional

import torch
from torch import nn

VALUE_HEAD_FILE = "value_head.safetensors"
CRITIC_META_FILE = "critic.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """Map a config dtype name ("float32", "bfloat16", "float16") to torch; ValueError names the value."""
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def autocast(dtype_name: Optional[str], device: torch.device | str):
    """`torch.autocast` to `dtype_name` ("bfloat16") on `device`'s type, or a no-op context for None.

    Wraps model calls only: matmuls run in bfloat16, while parameters, gradients and optimizer state keep
    their own dtype (float32), and ppoflow's log-softmax / value outputs are float32 (they cast).
    On CPU this uses AVX512-BF16 / AMX kernels where the CPU has them (measured 1.9x per forward+backward
    of a 10M-parameter Llama on one AMD EPYC core); without them it is emulated, ~16x slower, not wrong
    (preflight refuses it there: engines/precision.py).
    """
    if dtype_name is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch_dtype(dtype_name))


def precast_linear_weights(model: nn.Module, autocast_dtype: Optional[str]) -> int:
    """Store a frozen model's nn.Linear weights and biases in `autocast_dtype` once, instead of letting
    autocast cast them on every call. Returns how many Linear modules were converted.

    Under torch.autocast a Linear casts its float32 weight to the autocast dtype at every call; a sampler
    calls each Linear once per generated token, so the casts cost as much as the matmuls themselves on CPU
    (64 rows x 512 -> 1536: 0.99 ms with the cast, 0.51 ms without). The cast weight is the same bf16 value
    autocast would have made (round to nearest even either way), so outputs are bit-for-bit unchanged.
    Only for models that do not train (the rollout sampler, the reference): a trainer's weights move every
    step. A Linear whose weight is shared with another kind of module (an LM head tied to the input
    embedding) keeps float32: the embedding runs outside autocast's cast list and must stay as it was.
    Later in-place loads (`param.copy_(float32 tensor)`) round to the stored dtype the same way.
    """
    if autocast_dtype is None:
        return 0
    dtype = torch_dtype(autocast_dtype)
    holders: dict[int, set[type]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), set()).add(nn.Linear if isinstance(module, nn.Linear) else type(module))
    converted = 0
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            continue
        params = [p for p in (module.weight, module.bias) if p is not None]
        if any(holders[id(p)] != {nn.Linear} for p in params) or not params[0].is_floating_point():
            continue
        for p in params:
            p.data = p.data.to(dtype)  # in place on the Parameter: Linears that share it stay shared
        converted += 1
    return converted


def weight_files(folder: str | Path) -> list[Path]:
    """The *.safetensors files of a Hugging Face folder, sorted by name (one file or the shards; [] if none)."""
    return sorted(Path(folder).glob("*.safetensors"))


def _check_model_dir(path: str | Path, what: str) -> Path:
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{what} folder {str(folder)!r} has no config.json (expected a Hugging Face "
            f"folder written by save_pretrained)"
        )
    return folder


class TokenizerError(ValueError):
    """A model folder's tokenizer does not load; the message names the folder and, where it can tell, the file."""


def load_tokenizer(path: str | Path):
    """The tokenizer of a model folder. Left padding: prompts are left-padded everywhere in ppoflow.

    Raises FileNotFoundError for a folder without config.json, TokenizerError when the tokenizer does not load
    (a corrupt tokenizer.json names itself; otherwise transformers' or tokenizers' own error and the files)."""
    from transformers import AutoTokenizer

    from engines.model_files import tokenizer_json_problem

    folder = _check_model_dir(path, "tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - json, transformers and tokenizers (Rust) raise many types: name the files
        problem = tokenizer_json_problem(folder)
        files = ", ".join(sorted(p.name for p in folder.iterdir() if "token" in p.name or p.name.startswith("vocab")))
        raise TokenizerError(
            f"the tokenizer in {folder} does not load: "
            + (problem or f"{type(e).__name__}: {str(e).strip()} (its files: {files or 'none'})")
        ) from e
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        # Some causal LMs ship no pad token; EOS is the usual stand-in (masks keep it out of the loss).
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(path: str | Path, dtype: str = "float32", attn_implementation: str = "sdpa"):
    """The causal-LM policy (`AutoModelForCausalLM`) in train mode, on CPU; the caller moves it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(_check_model_dir(path, "policy")), dtype=torch_dtype(dtype), attn_implementation=attn_implementation
    )
    model.train()
    return model


def load_reference(path: str | Path, dtype: str = "float32", attn_implementation: str = "sdpa"):
    """A frozen copy of the initial policy: eval mode, every parameter with requires_grad=False."""
    model = load_policy(path, dtype, attn_implementation)
    model.eval()
    model.requires_grad_(False)
    return model


class ValueHeadModel(nn.Module):
    """Critic: causal-LM backbone (no LM head) + a linear value head.

    forward(input_ids (B, T), attention_mask (B, T), position_ids (B, T)) -> values (B, T), float32.
    `values[:, t]` is the value of the state after reading tokens 0..t.
    """

    def __init__(self, backbone: nn.Module, value_head: Optional[nn.Linear] = None):
        super().__init__()
        self.backbone = backbone
        hidden = backbone.config.hidden_size
        if value_head is None:
            value_head = nn.Linear(hidden, 1, bias=True)
            # Small init (OpenRLHF uses std 1/(hidden+1)): initial values near 0, so early value losses are sane.
            nn.init.normal_(value_head.weight, std=1.0 / (hidden + 1))
            nn.init.zeros_(value_head.bias)
        self.value_head = value_head.to(next(backbone.parameters()).dtype)

    @property
    def config(self):
        return self.backbone.config

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        out = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        return self.value_head(out.last_hidden_state).squeeze(-1).float()

    def gradient_checkpointing_enable(self) -> None:
        self.backbone.gradient_checkpointing_enable()

    def save(
        self, out_dir: str | Path, tokenizer=None, state_dict: Optional[dict[str, torch.Tensor]] = None
    ) -> dict[str, str]:
        """Write backbone (save_pretrained), value_head.safetensors and critic.json to `out_dir`.

        state_dict: this module's full state dict ("backbone.*", "value_head.*") when its own parameters are
        not whole (ZeRO-3 partitions them: the trainer passes the gathered copy); None = the live tensors.

        Returns {file name: sha256} of the safetensors files, hashed as they were written (engines/hf_save.py).
        """
        from engines.hf_save import save_pretrained_hashed
        from engines.trainer.state import write_safetensors

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        full = self.state_dict() if state_dict is None else state_dict
        backbone = {k.removeprefix("backbone."): v for k, v in full.items() if k.startswith("backbone.")}
        digests = save_pretrained_hashed(self.backbone, out, state_dict=backbone if state_dict is not None else None)
        head = {
            k.removeprefix("value_head."): v.detach().contiguous().cpu()
            for k, v in full.items()
            if k.startswith("value_head.")
        }
        digests[VALUE_HEAD_FILE] = write_safetensors(head, out / VALUE_HEAD_FILE)
        (out / CRITIC_META_FILE).write_text(json.dumps({"kind": "value_head", "hidden_size": self.config.hidden_size}))
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
        return digests


def _reward_model_score_head(folder: Path, hidden: int) -> Optional[nn.Linear]:
    """The `score` head of a one-label sequence-classification folder as a Linear(hidden, 1), else None."""
    from safetensors import safe_open

    config = json.loads((folder / "config.json").read_text())
    if not any(a.endswith("ForSequenceClassification") for a in config.get("architectures") or []):
        return None
    for weights in weight_files(folder):
        with safe_open(str(weights), framework="pt") as f:
            if "score.weight" in f.keys():
                weight = f.get_tensor("score.weight")
                if tuple(weight.shape) != (1, hidden):
                    return None  # several labels: shapes do not fit, start a new head
                head = nn.Linear(hidden, 1, bias="score.bias" in f.keys())
                with torch.no_grad():
                    head.weight.copy_(weight.float())
                    if head.bias is not None:
                        head.bias.copy_(f.get_tensor("score.bias").float())
                if head.bias is None:
                    head.bias = nn.Parameter(torch.zeros(1))
                return head
    return None


def load_critic(path: str | Path, dtype: str = "float32", attn_implementation: str = "sdpa") -> ValueHeadModel:
    """The critic from a saved critic folder, a reward-model folder or a policy folder.

    - saved critic (has value_head.safetensors): backbone + that head, exactly as saved;
    - reward model (`*ForSequenceClassification`, one label): backbone + its score head as the init;
    - causal LM (the policy): backbone + a new small-init head.
    Raises FileNotFoundError when `path` is not a Hugging Face folder.
    """
    from safetensors.torch import load_file
    from transformers import AutoModel

    folder = _check_model_dir(path, "critic")
    backbone = AutoModel.from_pretrained(str(folder), dtype=torch_dtype(dtype), attn_implementation=attn_implementation)
    hidden = backbone.config.hidden_size
    head: Optional[nn.Linear] = None
    if (folder / VALUE_HEAD_FILE).is_file():
        state = load_file(str(folder / VALUE_HEAD_FILE))
        head = nn.Linear(hidden, 1, bias=True)
        head.load_state_dict(state)
    else:
        head = _reward_model_score_head(folder, hidden)
    critic = ValueHeadModel(backbone, head)
    critic.train()
    return critic
