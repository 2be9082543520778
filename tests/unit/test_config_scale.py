"""Config checks of the scaling settings (train.offload, model.lora): impossible combinations fail before work."""

import pytest

from ppoflow.config import ConfigError, load_config


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["train.zero_stage=0", "train.offload=optimizer"], ("train.offload", "train.zero_stage")),
        (["train.zero_stage=2", "train.offload=optimizer_and_params"], ("train.offload", "train.zero_stage=3")),
        (["train.zero_stage=0", "train.offload=optimizer_and_params"], ("train.offload", "train.zero_stage")),
        (["train.offload=disk"], ("train.offload", "disk")),
    ],
)
def test_offload_against_the_zero_stage_names_both_fields(overrides, named):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    for name in named:
        assert name in str(err.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ["train.zero_stage=1", "train.offload=optimizer"],
        ["train.zero_stage=2", "train.offload=optimizer"],
        ["train.zero_stage=3", "train.offload=optimizer"],
        ["train.zero_stage=3", "train.offload=optimizer_and_params"],
        ["train.zero_stage=0", "train.offload=none"],
    ],
)
def test_offload_combinations_deepspeed_supports_are_accepted(overrides):
    load_config(None, overrides)


@pytest.mark.parametrize(
    "overrides, stage",
    [
        ([], 0),  # float32 weights (the default dtype), no offload: nothing for ZeRO's fp32 partition to add
        (["model.dtype=bfloat16"], 2),
        (["model.dtype=float16"], 2),
        (["model.autocast_dtype=bfloat16"], 0),  # weights stay float32 under autocast
        (["train.offload=optimizer"], 2),
        (["train.offload=optimizer_and_params"], 3),  # the one stage that partitions parameters
        (["train.num_ranks=2", "train.micro_batch_size=2"], 0),
        (["train.zero_stage=2"], 2),  # a stage set is kept
        (["model.dtype=bfloat16", "train.zero_stage=0"], 0),
    ],
)
def test_an_unset_zero_stage_is_chosen_and_written_to_the_saved_config(overrides, stage):
    cfg = load_config(None, overrides)
    assert cfg.train.zero_stage == stage
    assert f"zero_stage: {stage}" in cfg.to_yaml()


def test_lora_section_from_dotted_overrides_and_its_bounds():
    cfg = load_config(None, ["model.lora.rank=4", "model.lora.target_modules=[q_proj, v_proj]"])
    lora = cfg.model.lora
    assert lora.rank == 4 and lora.alpha == 16.0 and lora.target_modules == ["q_proj", "v_proj"]
    assert load_config(None).model.lora is None
    for bad, field in (
        ("model.lora.rank=0", "model.lora.rank"),
        ("model.lora.dropout=1.0", "model.lora.dropout"),
        ("model.lora.target_modules=[]", "model.lora.target_modules"),
    ):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config(None, [bad])


def test_optimizer_state_every_is_refused_on_several_ranks_and_below_one():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.optimizer_state_every=4", "train.num_ranks=2"])
    assert "train.optimizer_state_every=4" in str(err.value) and "train.num_ranks=2" in str(err.value)
    with pytest.raises(ConfigError, match=r"train\.optimizer_state_every"):
        load_config(None, ["train.optimizer_state_every=0"])
    assert load_config(None, ["train.optimizer_state_every=4"]).train.optimizer_state_every == 4
    assert load_config(None, ["train.num_ranks=2"]).train.optimizer_state_every == 1
