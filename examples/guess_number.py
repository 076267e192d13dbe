"""An environment in a user's own file: guess the number, a game in which the environment
answers each move. Train with it from the repository root:

    python distributed_train.py --config examples/guess_number.yaml

The environment thinks of a number from 1 to 100 (the prompt decides which: the same prompt,
the same number, so runs repeat and resume exactly), reads the last number of each of the
model's turns as its guess and answers "higher" or "lower" as the user, until the guess is
right, the model stops guessing, or max_tool_calls rounds are spent. A right guess earns the
reward part `solved` (1); the reward plugin `guesses` below takes 0.05 off per guess, from the
conversation that reward plugins see as meta["messages"].
"""

import random
import re

from mini_grpo.envs import Step
from mini_grpo.rewards import per_sample

LOW, HIGH = 1, 100


class GuessNumber:
    def reset(self, prompt):
        text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        self.secret = random.Random(text).randint(LOW, HIGH)
        return None  # the task's prompt as it is

    def step(self, reply: str) -> Step:
        numbers = re.findall(r"\d+", reply[-200:])
        if not numbers:  # no guess: the game is over
            return Step([], done=True)
        guess = int(numbers[-1][:4])
        if guess == self.secret:
            return Step([], done=True, rewards={"solved": 1.0})
        hint = "higher" if guess < self.secret else "lower"
        return Step([{"role": "user", "content": f"{guess} is wrong: go {hint}."}], done=False)


@per_sample
def guesses(prompt: str, completion: str, target: str, meta: dict) -> float:
    """-0.05 per guess the model made (each of its turns)."""
    return -0.05 * sum(m["role"] == "assistant" for m in meta.get("messages", []))
