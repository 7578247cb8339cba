"""``prompt``: the prompt optimiser and when it runs beside ES; ``prompt.skill``: skill synthesis's settings.

Validation raises ``ValueError`` naming the dotted key (the trainer's config turns it into its ConfigError).
"""
from __future__ import annotations

import dataclasses
import math
import os


def _check(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{key}: {msg}")


PROMPT_OPTIMISERS = ("none", "sample", "eoh", "skill")
SKILL_PROPOSERS = ("policy", "endpoint")


@dataclasses.dataclass
class SkillConfig:
    """``prompt.optimiser=skill``: who proposes SKILL.md edits, from how many episodes, validated on how many tasks."""
    proposer: str = "policy"  # policy (the run's own model, unperturbed) | endpoint (OpenAI-compatible, at url)
    url: str = ""  # endpoint: base URL, e.g. http://host:8000 (POST /v1/chat/completions)
    model: str = ""  # endpoint: the served model's name
    key_env: str = "OPENAI_API_KEY"  # endpoint: environment variable holding the API key (read at call time)
    batch: int = 4  # trajectories per proposer call (the step's trajectories split into parallel batches)
    success: float = 0.5  # an episode returning at least this counts as successful
    val_tasks: int = 2  # held-out mini-batch: training tasks the step did not play, per validation
    max_new_tokens: int = 256  # policy: tokens of one proposal
    temperature: float = 0.7  # proposal sampling temperature
    initial: str = ""  # path of the starting SKILL.md ('': a template with ## Strategy and ## Pitfalls)
    max_chars: int = 4000  # a candidate SKILL.md longer than this is rejected unvalidated (it joins every prompt)
    timeout_s: float = 120.0  # endpoint: seconds one request may take (a failed request proposes no edits)

    def validate(self, key: str = "prompt.skill") -> None:
        _check(self.proposer in SKILL_PROPOSERS, f"{key}.proposer",
               f"must be one of {SKILL_PROPOSERS}, got {self.proposer!r}")
        if self.proposer == "endpoint":
            _check(self.url.startswith(("http://", "https://")), f"{key}.url",
                   f"proposer=endpoint needs an http(s) URL, got {self.url!r}")
            _check(bool(self.model), f"{key}.model", "proposer=endpoint needs the served model's name")
        _check(self.batch >= 1, f"{key}.batch", f"must be >= 1, got {self.batch}")
        _check(math.isfinite(self.success), f"{key}.success", f"must be finite, got {self.success}")
        _check(self.val_tasks >= 1, f"{key}.val_tasks", f"must be >= 1, got {self.val_tasks}")
        _check(self.max_new_tokens >= 1, f"{key}.max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        _check(math.isfinite(self.temperature) and self.temperature >= 0, f"{key}.temperature",
               f"must be finite and >= 0, got {self.temperature}")
        _check(self.max_chars >= 200, f"{key}.max_chars", f"must be >= 200 characters, got {self.max_chars}")
        _check(math.isfinite(self.timeout_s) and self.timeout_s > 0, f"{key}.timeout_s",
               f"must be a finite number of seconds > 0, got {self.timeout_s}")
        _check(not self.initial or os.path.isfile(self.initial), f"{key}.initial",
               f"no such file: {self.initial!r}")
PROMPT_MODES = ("joint", "alternate", "prompt_only")


@dataclasses.dataclass
class PromptConfig:
    """The prompt optimiser (esopt_mp/prompt) and when it runs beside ES; ``none`` (default) leaves runs as before."""
    optimiser: str = "none"  # none | sample | eoh (program-search environments: the search state is the context)
    mode: str = "joint"  # joint (ES every step, context every k) | alternate | prompt_only (ES off)
    every: int = 1  # joint / prompt_only: update the context after every k-th step
    population: int = 4  # eoh: survivors kept
    parents: int = 2  # eoh: parents of a crossover prompt
    skill: SkillConfig = dataclasses.field(default_factory=SkillConfig)

    def validate(self, key: str = "prompt") -> None:
        _check(self.optimiser in PROMPT_OPTIMISERS, f"{key}.optimiser",
               f"must be one of {PROMPT_OPTIMISERS}, got {self.optimiser!r}")
        _check(self.mode in PROMPT_MODES, f"{key}.mode", f"must be one of {PROMPT_MODES}, got {self.mode!r}")
        _check(self.every >= 1, f"{key}.every", f"must be >= 1, got {self.every}")
        _check(self.population >= 1, f"{key}.population", f"must be >= 1, got {self.population}")
        _check(self.parents >= 2, f"{key}.parents", f"must be >= 2, got {self.parents}")
        if self.optimiser == "skill":
            self.skill.validate(f"{key}.skill")
