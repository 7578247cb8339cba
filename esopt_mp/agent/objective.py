"""ES objective over agent episodes: a member's return is its mean episode return.

Every member of a step plays the same tasks (common random numbers, drawn from
the run's ``tasks`` stream); token sampling uses the ``episode`` stream. The TP
leader of each dp group plays the episodes; its peers join the forward passes.
Held-out evaluation plays every eval task ``eval_repeats`` times with the
unperturbed weights.
"""
from __future__ import annotations

import math
import os
import random

from esopt_mp.agent.loop import AgentConfig, follow_episodes, run_episodes, write_trajectories
from esopt_mp.data import resolve
from esopt_mp.engine.hf import HFEngine
from esopt_mp.envs import make
from esopt_mp.es.seeds import stream_seed


def load_tasks(cfg) -> tuple[list[dict], list[dict]]:
    """(train, eval) tasks of the configured environment: from JSONL files or generated."""
    if cfg.name == "sudoku":
        from esopt_mp.envs import sudoku as m

        load = lambda p, n: m.load_jsonl(p, cfg.mask_count)[:n]  # noqa: E731
        gen = lambda n, s: m.generate(n, cfg.mask_count, size=cfg.size, seed=s)  # noqa: E731
    elif cfg.name == "math_react":
        from esopt_mp.envs import math_react as m

        load = lambda p, n: m.load_jsonl(p)[:n]  # noqa: E731
        gen = lambda n, s: m.generate(n, seed=s)  # noqa: E731
    else:
        from esopt_mp.envs import heuristic as m

        load = None
        gen = lambda n, s: m.generate(n, seed=s)  # noqa: E731
    train_path, eval_path = resolve(cfg.train_path), resolve(cfg.eval_path)  # "data:..." -> the shipped file
    train = load(train_path, cfg.n_train) if train_path and load else gen(cfg.n_train, cfg.task_seed)
    held = load(eval_path, cfg.n_eval) if eval_path and load else gen(cfg.n_eval * 2, cfg.task_seed + 1)
    key = lambda t: str(t.get("puzzle", t.get("question", t.get("seed"))))  # noqa: E731 - what makes a task
    seen = {key(t) for t in train}
    held = [t for t in held if key(t) not in seen][: cfg.n_eval]
    if len(train) < cfg.episodes_per_step or not held:
        raise ValueError(f"env: {len(train)} training and {len(held)} held-out tasks are not enough")
    return train, held


class AgentObjective:
    def __init__(self, env_cfg, engine_cfg, run_seed: int, model, tokenizer, dims, traj_path: str | None = None):
        self.cfg, self.run_seed, self.dims = env_cfg, run_seed, dims
        self.engine = HFEngine(model, tokenizer, prefix_reuse=engine_cfg.prefix_reuse)
        self.train_cfg = AgentConfig(env_cfg.max_turns, engine_cfg.sampling())
        self.eval_cfg = AgentConfig(env_cfg.max_turns, engine_cfg.sampling(env_cfg.eval_temperature))
        self.train_tasks, self.eval_tasks = load_tasks(env_cfg)
        self.traj_path = traj_path if traj_path and dims.rank == 0 else None
        self.eval_round = 0

    def _play(self, tasks, seeds, cfg, **tags) -> float:
        if not self.dims.is_tp_leader:
            follow_episodes(self.engine, cfg, self.dims)
            return math.nan
        extra = {"show_original": self.cfg.show_original, "hints": self.cfg.hints} if self.cfg.name == "sudoku" else {}
        envs = [make(self.cfg.name, max_turns=self.cfg.max_turns, **extra) for _ in tasks]
        eps = run_episodes(self.engine, envs, tasks, seeds, cfg, self.dims)
        if self.traj_path:
            write_trajectories(self.traj_path, eps, **tags)
        finite = [e.ret for e in eps if not math.isnan(e.ret)]
        return sum(finite) / len(finite) if finite else math.nan

    def step_tasks(self, step: int) -> list[dict]:
        rng = random.Random(stream_seed(self.run_seed, "tasks", step))
        return [self.train_tasks[i] for i in rng.sample(range(len(self.train_tasks)), self.cfg.episodes_per_step)]

    def evaluate(self, model, member) -> float:
        if member is None:
            if self.dims.dp_rank != 0:  # one dp group evaluates; the others would repeat it
                return math.nan
            r = self.eval_round
            self.eval_round += 1
            tasks = self.eval_tasks * self.cfg.eval_repeats
            seeds = [stream_seed(self.run_seed, "eval", r, e) for e in range(len(tasks))]
            return self._play(tasks, seeds, self.eval_cfg, kind="eval", round=r)
        tasks = self.step_tasks(member.step)
        seeds = [stream_seed(self.run_seed, "episode", member.step, member.index, e) for e in range(len(tasks))]
        return self._play(tasks, seeds, self.train_cfg, kind="train", step=member.step, member=member.index)
