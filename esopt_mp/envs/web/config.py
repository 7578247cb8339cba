"""``env.webarena_lite``: the WebArena-Lite environment's settings (browser, budgets, tasks, sites, judge)."""
from __future__ import annotations

import dataclasses
import math

SPLITS = ("all", "train", "heldout")


@dataclasses.dataclass
class WebConfig:
    """Settings of ``webarena_lite`` (:mod:`esopt_mp.envs.web.env`); ``None`` paths fall back to the environment."""

    chromium: str | None = None  # browser binary; None: $ESOPT_CHROMIUM, else Debian's chromium-headless-shell
    browsers_path: str | None = None  # PLAYWRIGHT_BROWSERS_PATH prepared by tools/setup_browser.py; None: env var
    nltk_data: str | None = None  # folder holding tokenizers/punkt_tab/english; None: $NLTK_DATA
    suite: str = "webarena_lite"  # webarena_lite | demo (esopt_mp.envs.web.demo: a loopback site, CPU runs and tests)
    task_ids: list[int] = dataclasses.field(default_factory=list)  # WebArena-Lite ids; empty: the split's tasks
    split: str = "all"  # all | train | heldout (esopt_mp.envs.web.tasks.split_ids: ids % 5 == 0 are held out)
    answer_only: bool = False  # only tasks scored on the final answer (string_match), no live-site state needed
    obs_tokens: int = 3000  # accessibility-tree budget (estimated at 4 characters a token)
    step_timeout_s: float = 30.0  # one browser action (playwright's timeout) and its wall clock (enforced)
    reset_timeout_s: float = 120.0  # opening the browser and the task's setup (WebArena: logins), wall clock
    episode_timeout_s: float = 600.0  # reset to last step, wall clock
    max_browsers: int = 4  # concurrent episodes (each one browser, ~400 MB) per TP leader
    settle_s: float = 0.5  # wait after each action before observing (BrowserGym's pre_observation_delay)
    preflight_timeout_s: float = 10.0  # per site, before any rollout
    # at the run's start (and each resume): BrowserGym's WebArena full reset (GET $WA_FULL_RESET/reset, then
    # /status until ready), every site back to its initial state; the only reset the benchmark has
    full_reset: bool = False
    # the LLM judge of fuzzy_match tasks: $OPENAI_BASE_URL + $OPENAI_API_KEY (the names BrowserGym's webarena reads;
    # unset: those tasks are excluded and counted), serving the model esopt_mp.envs.web.tasks.JUDGE_MODEL

    def validate(self, key: str = "env.webarena_lite") -> None:
        def check(cond: bool, k: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"{key}.{k}: {msg}")

        check(self.suite in ("webarena_lite", "demo"), "suite", f"must be webarena_lite or demo, got {self.suite!r}")
        check(self.split in SPLITS, "split", f"must be one of {SPLITS}, got {self.split!r}")
        check(all(isinstance(i, int) and 0 <= i for i in self.task_ids), "task_ids",
              f"must be WebArena-Lite task ids (integers >= 0), got {self.task_ids}")
        check(self.obs_tokens >= 64, "obs_tokens", f"must be >= 64, got {self.obs_tokens}")
        for k in ("step_timeout_s", "reset_timeout_s", "episode_timeout_s", "preflight_timeout_s"):
            v = getattr(self, k)
            check(math.isfinite(v) and v > 0, k, f"must be a finite number of seconds > 0, got {v}")
        check(self.step_timeout_s <= self.episode_timeout_s, "step_timeout_s",
              f"{self.step_timeout_s} exceeds episode_timeout_s={self.episode_timeout_s}")
        check(self.reset_timeout_s <= self.episode_timeout_s, "reset_timeout_s",
              f"{self.reset_timeout_s} exceeds episode_timeout_s={self.episode_timeout_s}")
        check(self.max_browsers >= 1, "max_browsers", f"must be >= 1, got {self.max_browsers}")
        check(math.isfinite(self.settle_s) and 0 <= self.settle_s <= self.step_timeout_s, "settle_s",
              f"must be in [0, step_timeout_s], got {self.settle_s}")
