"""Two reward functions for grpo_variants.py's offline arithmetic task: copy one and edit it.

    python grpo_variants.py --reward_fn experiments/reward_fns.py:closeness --reward_weights 0.5
    python grpo_variants.py --no_verifier --reward_fn experiments/reward_fns.py:closeness \\
        --reward_fn experiments/reward_fns.py:answer_format --reward_weights 1 0.2

A reward function takes three lists of equal length: the prompts and the responses as text
(a response without its stop token) and each prompt's ground truth as the data stores it
(None where it has none). It returns one float per response, each scored on its own
(data/rewards.py). Their weighted sum is added to the verifier's and the reward model's.
"""

import re

# The arithmetic task's answer: a number right-aligned in three characters (" 55").
ANSWER = re.compile(r" *\d{1,3}")


def answer_format(prompts, responses, ground_truth):
    """1 for a response that is a number in the task's format, right or wrong; else 0."""
    return [float(ANSWER.fullmatch(response) is not None) for response in responses]


def closeness(prompts, responses, ground_truth):
    """Partial credit: 1 - |answer - truth| / 10, down to 0 ten or more off, and for a
    response that is no number or a prompt with no ground truth."""
    scores = []
    for response, truth in zip(responses, ground_truth):
        score = 0.0
        if truth is not None and ANSWER.fullmatch(response):
            error = abs(int(response) - int(truth))
            score = max(0.0, 1.0 - error / 10)
        scores.append(score)
    return scores
