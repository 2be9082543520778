"""The scorer's reference micro-batches keep a prompt's rows together, so its packed forward runs each prompt once.

The rows arrive round-robin over three groups of four samples (the order a rollout would never use, and the one in
which sorting by length alone scatters every group over the micro-batches). The reference's micro-batch is 8 rows
(scorer_config: train.micro_batch_size 8), so grouped by prompt the 12 rows are two micro-batches: groups 1 and 2,
then group 3. A hook on the first decoder layer counts the tokens each forward ran, against a hand count of the
packed sequence (engines/trainer/shared_prompt.py); the log-probs are checked against each row scored alone (a
plain forward of one row: no sharing, no batching), a second implementation.
"""

import torch

from engines.scoring.scorer import Scorer
from tests.unit.test_score_cache_logic import scorer_config, write_reward_file

# (prompt length, [response lengths of its 4 samples]); each group's longest row: 6 + 4, 5 + 4, 4 + 4 tokens
GROUPS = [(6, [3, 1, 2, 4]), (5, [4, 2, 1, 3]), (4, [2, 4, 3, 1])]


def round_robin_rows() -> tuple[list[list[int]], list[list[int]], list[int]]:
    """(prompt ids, response ids, group of each row), the groups' samples interleaved: g1[0], g2[0], g3[0], g1[1]..."""
    prompts, responses, groups = [], [], []
    for sample in range(4):
        for g, (prompt_len, response_lens) in enumerate(GROUPS):
            prompts.append([3 + g + t for t in range(prompt_len)])
            responses.append([10 + (sample + t) % 7 for t in range(response_lens[sample])])
            groups.append(g)
    return prompts, responses, groups


def test_reference_micro_batches_hold_whole_groups_and_score_as_rows_alone(tiny_model_dir, tmp_path):
    scorer = Scorer(scorer_config(tiny_model_dir, write_reward_file(tmp_path)[0]))
    prompts, responses, _ = round_robin_rows()
    model = scorer.reference.model
    seen = []
    hook = model.model.layers[0].mlp.register_forward_hook(lambda _m, _a, out: seen.append(tuple(out.shape[:2])))
    try:
        grouped = scorer.reference_logprobs(prompts, responses)
    finally:
        hook.remove()

    # by hand: micro-batch 1 = groups 1 and 2 (8 rows): prefixes of 6 - 1 and 5 - 1 tokens, then 8 suffixes of the
    # batch's longest response (4): 9 + 32 = 41 tokens. Micro-batch 2 = group 3: 4 - 1 + 4 x 4 = 19 tokens.
    assert seen == [(1, 41), (1, 19)]
    alone = [scorer.reference.logprobs([p], [r])[0] for p, r in zip(prompts, responses)]
    for row, (got, expected) in enumerate(zip(grouped, alone)):
        assert len(got) == len(responses[row])
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=0, atol=1e-5, msg=f"row {row}")
