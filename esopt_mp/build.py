"""One place that builds a run's parts, for both trainers and the dry run (the trainer itself:
:func:`esopt_mp.runner.build_trainer`).

- :func:`build_weights`: the model and the weight operations ES runs on it (:class:`esopt_mp.es.WeightOps`): a
  :class:`~esopt_mp.es.Perturber` on the hf model's shards, or the same Perturber inside vLLM's workers behind
  :class:`~esopt_mp.engine.vllm.VLLMWeights`; the trainer sees one interface.
- :func:`build_engine`: the rollout engine on an hf model; :func:`check_engine`: what a start checks of it.
- :data:`OBJECTIVE_KINDS`: what each ``objective.name`` builds, which tasks it plays and what its dry run checks;
  the objective kind is dispatched here and nowhere else (how an episodic kind plays, in process or against a
  served member, is ``objectives.IN_PROCESS`` / ``SERVED``, which the config's checks and the run identity read).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from esopt_mp.core.errors import StartupError


def check_engine(cfg) -> list[str]:
    """What a start checks of ``engine.name`` before anything is loaded, for the launcher and the dry run alike
    (vLLM importable, the model's architecture mapped; the hf engine needs nothing more): the lines it passed."""
    if cfg.engine.name != "vllm":
        return []
    from esopt_mp.engine.vllm import preflight

    preflight(cfg)
    return ["engine: vllm importable, the model's architecture mapped"]


def build_weights(cfg, dims, path: str, *, work_passes: float, cache_warm: bool):
    """(model or None, weight operations, engine or None): vLLM holds the weights and its workers run the Perturber
    (the engine comes with them); otherwise the hf model is loaded and a Perturber built on its shards. The noise
    backend is decided from ``work_passes`` and ``cache_warm`` (agreed by every rank) on both paths."""
    es = cfg.es
    if cfg.engine.name == "vllm":
        from esopt_mp.engine.vllm import build_vllm

        engine, weights, _ = build_vllm(cfg.engine, es, path, dims, cfg.model.dtype, cfg.run.seed,
                                        work_passes=work_passes, cache_warm=cache_warm)
        return None, weights, engine
    from esopt_mp.es import Perturber
    from esopt_mp.models import build_shards, load_model

    model = load_model(path, dims, cfg.model.dtype)
    weights = Perturber(build_shards(model, es.include, es.exclude), restore=es.restore, master=es.master,
                        chunk_elems=es.chunk_elems, noise_backend=es.noise_backend, work_passes=work_passes,
                        cache_warm=cache_warm, decay_to=es.decay_to,  # theta0: the base weights, before any resume
                        noise=es.noise, rank=es.rank)
    return model, weights, None


def build_engine(cfg, model, tokenizer, members=None):
    """The hf rollout engine on ``model`` (prefix reuse as ``engine.prefix_reuse`` says; ``members``: its batch of
    members, :func:`build_members`)."""
    from esopt_mp.engine.hf import HFEngine

    return HFEngine(model, tokenizer, prefix_reuse=cfg.engine.prefix_reuse, members=members)


def build_members(cfg, model, weights, engine=None):
    """``es.member_batch``: the hooks through which one batched generation plays every member of a dp group
    (:class:`esopt_mp.engine.members.MemberLinears` on the hf model; vLLM's engine brings its adapters); otherwise
    None."""
    if not cfg.es.member_batch:
        return None
    if getattr(engine, "members", None) is not None:
        return engine.members
    from esopt_mp.engine.members import MemberLinears

    return MemberLinears(model, weights)


def build_tokenizer(path: str, tokenizer=None):
    """``tokenizer`` if the engine brought one (vLLM's), else the model directory's."""
    if tokenizer is not None:
        return tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@dataclasses.dataclass
class Built:
    """An objective and what the trainer keeps of its build: the episode engine (None: no episodes) and the context
    run of ``prompt.*`` (None: none)."""

    objective: Any
    engine: Any = None
    context: Any = None
    tokenizer: Any = None


@dataclasses.dataclass(frozen=True)
class ObjectiveKind:
    """One ``objective.name``: how it is built, the tasks it plays (None: no episodes) and its dry-run lines."""

    build: Callable[..., Built]
    tasks: Callable[[Any], tuple[list, list]] | None = None
    check: Callable[[Any], list[str]] = lambda cfg: []


def build_objective(cfg, dims, path: str, *, model=None, engine=None, tokenizer=None, rank_file=None,
                    members=None) -> Built:
    """The objective of ``cfg.objective.name`` on ``model`` (or ``engine``, vLLM's); ``members``: the agent engine's
    batch of members (:func:`build_members`)."""
    return OBJECTIVE_KINDS[cfg.objective.name].build(cfg, dims, path, model=model, engine=engine,
                                                      tokenizer=tokenizer, **({"members": members} if members else {}))


def _build_agent(cfg, dims, path, *, model, engine, tokenizer, members=None) -> Built:
    """The episode player on ``engine`` (vllm) or an hf engine on the model; the context run, if configured, built
    on the player (skill hooks, the seed program's fitness); the objective on both."""
    import logging

    from esopt_mp.agent.episodes import AgentObjective

    tokenizer = build_tokenizer(path, tokenizer)
    engine = engine or build_engine(cfg, model, tokenizer, members)
    search = cfg.prompt.optimiser not in ("none", "skill")  # program search: fitness compared across programs
    player = build_player(cfg, dims, engine, fixed_task=search)
    context = None
    if cfg.prompt.optimiser != "none":
        from esopt_mp.prompt.run import PromptRun

        ref, hooks, fit, thought = "", None, None, ""
        if cfg.prompt.optimiser == "skill":  # proposals and validation on this run's unperturbed model
            from esopt_mp.agent import skill_hooks as skill

            hooks = skill.skill_hooks(player, cfg.prompt.skill)
        else:
            ref, thought = cfg.env.spec.search_seed(cfg.env.section)  # the seed program and what it does
            # the seed competes with its fitness (evaluated once, outside the program budget), not unscored
            fit = player.score_program(ref)
            logging.getLogger(__name__).info("seed program fitness %s (evaluated once, not counted in the budget)",
                                             fit)
        context = PromptRun(cfg.prompt, ref, cfg.run.dir, dims.rank, hooks, seed_fitness=fit, seed_thought=thought)
    return Built(AgentObjective(player, context), player.engine, context, tokenizer)


def build_player(cfg, dims, engine, *, fixed_task: bool = False):
    """The episode player of ``cfg.env`` on ``engine``, writing this rank's trajectories: the ES agent objective's
    and the GRPO/PPO trainer's (``fixed_task``: every member plays the same tasks, for a program search)."""
    from esopt_mp.agent.episodes import EpisodePlayer
    from esopt_mp.runfiles import trajectories_file

    return EpisodePlayer(cfg.env, cfg.engine, cfg.run.seed, engine, dims, trajectories_file(cfg, dims.rank),
                         fixed_task=fixed_task)


def _build_harness(cfg, dims, path, *, model, engine, tokenizer, members=None) -> Built:
    """An hf engine on the model (or ``engine``, vllm's), served by an endpoint on each TP leader while a member
    is evaluated; the harness plays against it (esopt_mp/agent/harness.py)."""
    from esopt_mp.agent.harness import build_harness
    from esopt_mp.runfiles import trajectories_file

    tokenizer = build_tokenizer(path, tokenizer)
    engine = engine or build_engine(cfg, model, tokenizer, members)
    objective = build_harness(cfg, engine, dims, trajectories_file(cfg, dims.rank))
    return Built(objective, objective.player.engine, None, tokenizer)


def _build_episodeless(cfg, dims, path, *, model, engine, tokenizer) -> Built:
    from esopt_mp.objectives import OBJECTIVES

    return Built(OBJECTIVES[cfg.objective.name](cfg.objective, model), tokenizer=tokenizer)


def _agent_tasks(cfg):
    from esopt_mp.agent.episodes import load_tasks

    return load_tasks(cfg.env)


def _harness_tasks(cfg):
    from esopt_mp.agent.harness import harness_tasks

    return harness_tasks(cfg.objective, cfg.env)


def _agent_check(cfg) -> list[str]:
    env = cfg.env
    try:
        env.spec.check(env.section, env, first=True)
    except Exception as e:  # noqa: BLE001 - whatever the env's check raised, in one line
        raise StartupError(f"env.name={env.name}: the start-up check failed: {type(e).__name__}: {e}") from None
    return [f"env: {env.name} start-up check passed"
            + (f" (sandbox level {env.sandbox.level})" if env.spec.runs_code else "")]


def _harness_check(cfg) -> list[str]:
    if not cfg.objective.command:
        return []
    from esopt_mp.agent.harness_run import command_argv

    try:
        command_argv(cfg.objective.command)
    except Exception as e:  # noqa: BLE001 - HarnessError: the program cannot be found
        raise StartupError(str(e)) from None
    return [f"harness: {cfg.objective.command}"]


# objective.name -> its kind (objectives.OBJECTIVES names them; the kinds with tasks are objectives.EPISODIC, checked
# equal by the tests)
OBJECTIVE_KINDS = {
    "agent": ObjectiveKind(_build_agent, _agent_tasks, _agent_check),
    "harness": ObjectiveKind(_build_harness, _harness_tasks, _harness_check),
    "target_logprob": ObjectiveKind(_build_episodeless),
    "seed_hash": ObjectiveKind(_build_episodeless),
}
