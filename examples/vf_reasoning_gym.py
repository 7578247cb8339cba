"""A verifiers (v1) taskset over reasoning-gym, playable offline: taskset id ``vf_reasoning_gym`` (``examples/`` on
``PYTHONPATH``), its harness verifiers' chat program on this interpreter (subprocess runtime).

Each task is one entry of a reasoning-gym dataset (its question; the library's system prompt asks for the answer in
``<answer>...</answer>``); its reward is the dataset's own score of the answer read the library's way (in [0, 1]).
Trained by ES through the member's endpoint (docs/verifiers.md)::

    ESOPT_VERIFIERS_ENV='{"taskset": {"id": "vf_reasoning_gym", "dataset": "leg_counting"}}' PYTHONPATH=examples \\
        python launch/train.py objective=harness objective.callable=esopt_mp.agent.harnesses.verifiers_v1:play \\
        objective.tasks=tasks.jsonl objective.eval_tasks=eval.jsonl   # lines {"idx": 0}, {"idx": 1}, ...

and evaluated by verifiers itself against any OpenAI-compatible server, as any verifiers taskset is.
"""
from __future__ import annotations

import reasoning_gym
import verifiers.v1 as vf
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

from esopt_mp.agent.harnesses.verifiers_chat import LocalChatHarness

__all__ = ["ReasoningGymTaskset", "LocalChatHarness"]


class ReasoningGymConfig(vf.TasksetConfig):
    dataset: str = "leg_counting"
    """A reasoning-gym dataset name (``reasoning_gym.create_dataset``)."""
    seed: int = 0
    size: int = 1000
    config: dict = {}
    """The dataset's own settings (its ``create_dataset`` keywords)."""


class ReasoningGymData(vf.TaskData):
    answer: str
    entry: dict
    """The reasoning-gym entry (question, answer, metadata) its score reads."""


class ReasoningGymTask(vf.Task[ReasoningGymData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def answer_score(self, trace: vf.Trace) -> float:
        """The dataset's score of the answer in the last reply (0 without one)."""
        score = reasoning_gym.get_score_answer_fn(self.data.entry["metadata"]["source_dataset"])
        return float(score(extract_answer(trace.last_reply), self.data.entry))


class ReasoningGymTaskset(vf.Taskset[ReasoningGymTask, ReasoningGymConfig]):
    def load(self):
        c = self.config
        data = reasoning_gym.create_dataset(c.dataset, seed=c.seed, size=c.size, **c.config)
        for i in range(len(data)):
            entry = data[i]
            yield ReasoningGymTask(ReasoningGymData(
                id=f"{c.dataset}-{c.seed}-{i}", prompt=entry["question"], system_prompt=SYSTEM_PROMPTS["default"],
                answer=str(entry["answer"]), entry=entry), c.task)
