"""ES objective over agent episodes: a member's return is its mean episode return.

Every member of a step plays the same tasks (common random numbers, drawn from
the run's ``tasks`` stream); token sampling uses the ``episode`` stream. The TP
leader of each dp group plays the episodes; its peers join the forward passes.
Held-out evaluation plays every eval task ``eval_repeats`` times with the
unperturbed weights, spread over the dp groups (task i on group i % dp); one
all-reduce of (sum, count) gives every rank the mean that one group playing
all of them would get.
"""
from __future__ import annotations

import math
import random

import torch

from esopt_mp.agent.loop import AgentConfig, follow_episodes, run_episodes, write_trajectories
from esopt_mp.data import resolve
from esopt_mp.engine.hf import HFEngine
from esopt_mp.envs import make
from esopt_mp.envs.sandbox import Sandbox
from esopt_mp.es.seeds import stream_seed

CODE_ENVS = ("math_react", "heuristic")  # environments that run model-written code


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
        from esopt_mp.envs import ahd

        load = None  # the problem's train split for training, its val split held out (bpp_online: generated)
        gen = lambda n, s, split="train": ahd.generate_tasks(cfg.problem, n, seed=s, split=split)  # noqa: E731
    train_path, eval_path = resolve(cfg.train_path), resolve(cfg.eval_path)  # "data:..." -> the shipped file
    train = load(train_path, cfg.n_train) if train_path and load else gen(cfg.n_train, cfg.task_seed)
    held = load(eval_path, cfg.n_eval) if eval_path and load else gen(cfg.n_eval * 2, cfg.task_seed + 1,
                                                                      **({"split": "val"} if load is None else {}))
    key = lambda t: str(t.get("puzzle", t.get("question", t.get("seed"))))  # noqa: E731 - what makes a task
    seen = {key(t) for t in train}
    held = [t for t in held if key(t) not in seen][: cfg.n_eval]
    if len(train) < cfg.episodes_per_step or not held:
        raise ValueError(f"env: {len(train)} training and {len(held)} held-out tasks are not enough")
    return train, held


class AgentObjective:
    def __init__(self, env_cfg, engine_cfg, run_seed: int, model, tokenizer, dims, traj_path: str | None = None,
                 engine=None):
        """``engine``: a built engine (vllm); by default an hf engine on ``model``."""
        self.cfg, self.run_seed, self.dims = env_cfg, run_seed, dims
        self.engine = engine or HFEngine(model, tokenizer, prefix_reuse=engine_cfg.prefix_reuse)
        if dims.is_tp_leader and env_cfg.name in CODE_ENVS:  # refuse a too-weak sandbox now, not at episode 1
            Sandbox.from_config(env_cfg.sandbox)
        self.train_cfg = AgentConfig(env_cfg.max_turns, engine_cfg.sampling())
        self.eval_cfg = AgentConfig(env_cfg.max_turns, engine_cfg.sampling(env_cfg.eval_temperature))
        self.train_tasks, self.eval_tasks = load_tasks(env_cfg)
        self.traj_path = traj_path if traj_path and dims.rank == 0 else None
        self.eval_round = 0
        self.recent_errors: list[str] = []  # a few errors of the last episodes this rank played (health warnings)

    def _play(self, tasks, seeds, cfg, **tags) -> tuple[float, int]:
        """(sum, count) of the finite episode returns on the TP leader; (0, 0) on its peers."""
        if not self.dims.is_tp_leader:
            follow_episodes(self.engine, cfg, self.dims)
            return 0.0, 0
        eps = self.play(tasks, seeds, cfg, **tags)
        finite = [e.ret for e in eps if not math.isnan(e.ret)]
        return sum(finite), len(finite)

    def play(self, tasks, seeds, cfg, **tags) -> list:
        """The TP leader's episodes of ``tasks`` (one per seed), logged to the trajectories file."""
        extra = {"show_original": self.cfg.show_original, "hints": self.cfg.hints} if self.cfg.name == "sudoku" else {}
        extra = {"problem": self.cfg.problem} if self.cfg.name == "heuristic" else extra
        envs = [make(self.cfg.name, max_turns=self.cfg.max_turns, sandbox=self.cfg.sandbox, **extra) for _ in tasks]
        eps = run_episodes(self.engine, envs, tasks, seeds, cfg, self.dims)
        if self.traj_path:
            write_trajectories(self.traj_path, eps, **tags)
        self.recent_errors = [f"episode {e.id}: {e.error}" for e in eps if e.error][:3]
        return eps

    def step_tasks(self, step: int) -> list[dict]:
        rng = random.Random(stream_seed(self.run_seed, "tasks", step))
        return [self.train_tasks[i] for i in rng.sample(range(len(self.train_tasks)), self.cfg.episodes_per_step)]

    def evaluate(self, model, member) -> float:
        if member is None:
            return self._held_out()
        tasks = self.step_tasks(member.step)
        seeds = [stream_seed(self.run_seed, "episode", member.step, member.index, e) for e in range(len(tasks))]
        total, n = self._play(tasks, seeds, self.train_cfg, kind="train", step=member.step, member=member.index)
        return total / n if n else math.nan

    def _held_out(self) -> float:
        """Mean held-out return on every rank: dp group g plays tasks g, g + dp, ...; one all-reduce sums."""
        r = self.eval_round
        self.eval_round += 1
        tasks = self.eval_tasks * self.cfg.eval_repeats
        mine = range(self.dims.dp_rank, len(tasks), self.dims.dp)
        seeds = [stream_seed(self.run_seed, "eval", r, e) for e in mine]
        total, n = self._play([tasks[e] for e in mine], seeds, self.eval_cfg, kind="eval", round=r)
        total, n = self.dims.comm.all_reduce(torch.tensor([total, n], dtype=torch.float64), "sum", "world").tolist()
        return total / n if n else math.nan
