"""ES objective over a harness: any agent program plays each episode against the member's OpenAI-compatible endpoint.

While a member is evaluated, its dp group's TP leader serves it (:mod:`esopt_mp.endpoint`) and runs the harness
once per task (``objective.callable`` or ``objective.command``, :mod:`esopt_mp.agent.harness_run`), each episode
on its own base URL; the peers follow the leader's generations (``engine.lead``). The member's return is the mean
of its episodes' returns, with the failure rules of every episode. Tasks, seeds and the held-out evaluation are the
agent objective's: every member of a step plays the same tasks (the run's ``tasks`` stream), episode e of member m
samples with the ``episode`` stream, held-out samples with the ``eval`` stream (:class:`HeldOut`). Trajectories
are recorded from the endpoint's side: every request and reply of each episode, in ``trajectories.jsonl``.
"""
from __future__ import annotations

import json
import logging
import math
import os

from esopt_mp.agent.episodes import EpisodeTally, draw_step_tasks, load_tasks, return_total
from esopt_mp.agent.harness_run import (HarnessError, HarnessPool, callable_job, command_argv, command_job,
                                        load_callable)
from esopt_mp.agent.held_out import HeldOut
from esopt_mp.agent.loop import episode_record
from esopt_mp.core.types import Episode
from esopt_mp.engine.base import SamplingParams
from esopt_mp.engine.tp import replicated
from esopt_mp.parallel.collectives import first_failure
from esopt_mp.runfiles import open_run_file

log = logging.getLogger(__name__)


def read_tasks(path: str, key: str) -> list[dict]:
    """Every task of a JSONL file (one JSON object a line); one line naming the setting on a bad line."""
    from esopt_mp.data import resolve
    from esopt_mp.envs.spec import read_jsonl_tasks

    try:
        return read_jsonl_tasks(resolve(path), shown=path)
    except ValueError as e:
        raise HarnessError(f"{key}={e}") from None


def harness_tasks(obj_cfg, env_cfg) -> tuple[list[dict], list[dict]]:
    """(train, held-out) tasks: ``objective.tasks`` / ``objective.eval_tasks``, else ``env.name``'s splits."""
    train = read_tasks(obj_cfg.tasks, "objective.tasks") if obj_cfg.tasks else None
    held = read_tasks(obj_cfg.eval_tasks, "objective.eval_tasks") if obj_cfg.eval_tasks else None
    if train is None or held is None:
        try:
            env_train, env_held = load_tasks(env_cfg)
        except (ValueError, OSError, TypeError) as e:
            raise HarnessError(f"env.name={env_cfg.name}: its tasks: {e}") from e
        train, held = env_train if train is None else train, env_held if held is None else held
    train, held = json.loads(json.dumps(train, default=str)), json.loads(json.dumps(held, default=str))
    if len(train) < env_cfg.episodes_per_step or not held:
        raise HarnessError(f"objective=harness: {len(train)} training tasks (a step plays env.episodes_per_step="
                           f"{env_cfg.episodes_per_step}) and {len(held)} held-out tasks (at least 1) are not enough")
    return train, held


def agree(dims, error: str | None) -> None:
    """One verdict for all ranks (:func:`esopt_mp.parallel.collectives.first_failure`): if any rank's ``error`` is set,
    every rank raises :class:`HarnessError` with the lowest failing rank's line."""
    found = first_failure(dims, error or None)
    if found is not None:
        raise HarnessError(found[1])


class HarnessPlayer(EpisodeTally):
    """Plays episodes by running the harness against the served member: what :class:`HeldOut` asks of a player."""

    def __init__(self, obj_cfg, env_cfg, engine_cfg, run_seed: int, engine, dims, server=None, api_key: str = "",
                 traj_path: str | None = None):
        """``server``: the started :class:`esopt_mp.endpoint.EndpointServer` of this TP leader (None on peers);
        ``api_key``: the endpoint's bearer key ("" none), given to a command as OPENAI_API_KEY."""
        self.obj, self.cfg, self.run_seed, self.dims, self.server = obj_cfg, env_cfg, run_seed, dims, server
        self.engine = replicated(engine, dims)
        self.train_cfg = SamplingParams.of(engine_cfg)
        self.eval_cfg = SamplingParams.of(engine_cfg, env_cfg.eval_temperature)
        self.train_tasks, self.eval_tasks = harness_tasks(obj_cfg, env_cfg)
        if obj_cfg.callable:
            self.form, fn = f"objective.callable={obj_cfg.callable}", load_callable(obj_cfg.callable)
            self._job = lambda url, model, task: callable_job(fn, url, model, task, obj_cfg.failure_return)
        else:
            self.form, argv = f"objective.command={obj_cfg.command}", command_argv(obj_cfg.command)
            self._job = lambda url, model, task: command_job(argv, url, model, api_key, task, obj_cfg.failure_return,
                                                             tuple(obj_cfg.env), obj_cfg.openai_env)
        self.traj_path = traj_path if traj_path and dims.rank == 0 else None
        EpisodeTally.__init__(self)
        self.never_called: str | None = None  # the last play's line when none of its episodes called the endpoint

    def step_tasks(self, step: int) -> list[dict]:
        """The step's training tasks, drawn from the run's ``tasks`` stream (the same for every member)."""
        return draw_step_tasks(self.train_tasks, self.run_seed, step, self.cfg.episodes_per_step)

    def play(self, tasks, seeds, sampling: SamplingParams, slots=None, members=None, **tags) -> list[Episode]:
        """One harness run per task against the member served meanwhile (its conversation j=0 sampling with
        ``seeds[i]``); on TP peers [] after following the leader's generations. ``members``: each episode's member
        slot when several members play at once (es.member_batch; ``tags["member"]``: their indices): each is
        served under its own model id, all in one batch."""
        return self.engine.lead(lambda: self._play(tasks, seeds, sampling, slots, members, tags), sampling,
                                default=[])

    def _play(self, tasks, seeds, sampling, slots, members, tags) -> list[Episode]:
        if not tasks:  # a dp group with no share (fewer held-out episodes than groups) serves no member
            self.never_called = None
            return []
        if members is not None:
            models = [f"member-{tags['step']}-{tags['member'][s]}" for s in members]
        else:
            models = [f"member-{tags['step']}-{tags['member']}" if tags.get("kind") == "train"
                      else f"{tags.get('kind', 'eval')}-{tags.get('round', 0)}"] * len(tasks)
        slots = list(range(len(tasks))) if slots is None else list(slots)
        records: list = [None] * len(tasks)  # each episode's requests: those of its last attempt, the one counted
        never_called = []  # per attempt: None if any of its episodes called the endpoint, else why none did

        def attempt(idx):
            eps, reqs, never = self._attempt([tasks[i] for i in idx], [seeds[i] for i in idx], sampling,
                                             [slots[i] for i in idx], [models[i] for i in idx],
                                             None if members is None else [members[i] for i in idx])
            for i, r in zip(idx, reqs):
                records[i] = r
            never_called.append(never)
            return eps

        groups = None if members is None else \
            [[i for i, m in enumerate(models) if m == g] for g in dict.fromkeys(models)]
        eps = self.play_retrying(attempt, len(tasks), tags.get("kind"), groups)
        # the harness calls its endpoint if any attempt did (a site down at the start may fail a whole first one)
        self.never_called = None if None in never_called else never_called[0]
        if self.traj_path:
            for group in groups or [list(range(len(eps)))]:  # a member's episodes under its own index
                member = {} if members is None else {"member": tags["member"][members[group[0]]]}
                write_requests(self.traj_path, [eps[i] for i in group], [records[i] for i in group],
                               **{**tags, **member})
        self.tally(eps, tags.get("kind"))
        return eps

    def _attempt(self, tasks, seeds, sampling, slots, models, members=None
                 ) -> tuple[list[Episode], list[list], str | None]:
        """One harness run per task against the member served as ``models[k]`` (``members[k]``: its slot of the
        engine's members under es.member_batch, all served at once; a retry may hold only some of them): (the
        episodes, their requests, why none called the endpoint or None)."""
        o = self.obj
        names = list(dict.fromkeys(models))
        own = [[k for k, m in enumerate(models) if m == name] for name in names]
        batched = members is not None
        serving = self.server.members([(name, [seeds[k] for k in ks], members[ks[0]]) for name, ks in zip(
            names, own)], sampling) if batched else self.server.member(names[0], list(seeds), sampling)
        with serving as opened:
            group = opened if batched else [opened]
            served = {name: iter(m.routes) for name, m in zip(names, group)}
            routes = [next(served[m]) for m in models]  # each member's routes, in its episodes' order
            urls = [r.base_url for r in routes]
            pool = HarnessPool([self._job(u, m, t) for u, m, t in zip(urls, models, tasks)], o.concurrency,
                               o.timeout_s, o.failure_return).start()
            try:
                group[0].serve(self.engine, live=pool.live, until=pool.done)
            except BaseException:
                pool.cancel()
                raise
            pool.wait()
            records = [list(r.records) for r in routes]
            calls = [_count(r.calls) for r in routes]
        eps = []
        for k, (task, out) in enumerate(zip(tasks, pool.outcomes)):
            if not calls[k] and out.failure != "wall_clock":  # the model had no part in it
                what = out.error or f"returned {out.ret!r}"
                out.ret, out.failure, out.error = math.nan, "infra", f"{what}; {_unanswered(records[k], urls[k])}"
            ep = Episode(str(task.get("id", slots[k])), ret=out.ret, ended=out.ended, error=out.error,
                         failure=out.failure, floor=o.failure_return, seconds=out.seconds)
            eps.append(ep)
            if out.failure:
                log.warning("episode %s of %s failed (%s): %s", ep.id, models[k], out.failure, out.error)
        never_called = None if any(calls) else (
            f"{self.form}: none of the {len(tasks)} episodes of {', '.join(names)} got a reply from the endpoint it "
            f"was given "
            f"(e.g. {urls[0]}): " + (f"the first episode: {eps[0].error}" if any(records) else
                                     "no request for this member reached it; send the harness's chat requests to "
                                     "that base URL, naming the model it was given "
                                     "(a command: $OPENAI_BASE_URL)" + (f"; the first episode: {eps[0].error}"
                                                                         if eps[0].error else "")))
        return eps, records, never_called


def _unanswered(records: list, url: str) -> str:
    """Why an episode got no reply: it never asked ``url``, or each of its requests was refused (the first's error)."""
    if not records:
        return f"it got no reply from the endpoint {url}"
    return f"none of its {len(records)} requests to {url} was answered (the first: {records[0].get('error')})"


def _count(calls) -> int:
    return calls if isinstance(calls, int) else len(calls)


def write_requests(path: str, eps: list[Episode], records: list[list], **tags) -> None:
    """One JSON line per episode: the tags (kind, step, member...), its return, how it ended, and every request
    and reply the endpoint saw from it."""
    with open_run_file(path, "a") as f:  # never through a link planted in run.dir
        for ep, reqs in zip(eps, records):
            row = {k: v for k, v in episode_record(ep).items() if k != "turns"}
            f.write(json.dumps({**tags, **row, "requests": reqs}, default=str) + "\n")


class HarnessObjective:
    """The ES trainer's objective of ``objective.name=harness`` (what :class:`esopt_mp.objectives.Objective` asks)."""

    def __init__(self, player: HarnessPlayer):
        self.player = player
        self.held_out = HeldOut(player)
        self._checked = False  # the first evaluation checked that the harness calls its endpoint

    def evaluate_member(self, member) -> float:
        """Member ``member``'s mean return over its step's tasks (NaN if every episode was an infrastructure fault)."""
        p = self.player
        tasks, seeds = p.member_episodes(member)
        eps = p.play(tasks, seeds, p.train_cfg, kind="train", step=member.step, member=member.index)
        self._check_called()
        total, n = return_total(eps)
        return total / n if n else math.nan

    def evaluate_members(self, members: list, batched: bool = False) -> dict[int, float]:
        """Each member's mean return (:meth:`evaluate_member`); ``batched``: all of them served at once, member
        ``members[s]`` at slot s of the engine's members (es.member_batch: the weights are not perturbed)."""
        if not batched:
            return {m.index: self.evaluate_member(m) for m in members}
        p = self.player
        tasks, seeds, which = [], [], []
        for s, member in enumerate(members):
            t, sd = p.member_episodes(member)
            tasks, seeds, which = tasks + t, seeds + sd, which + [s] * len(t)
        eps = p.play(tasks, seeds, p.train_cfg, members=which, kind="train", step=members[0].step,
                     member=[m.index for m in members])
        self._check_called()
        out = {}
        for s, member in enumerate(members):  # a TP peer played nothing: NaN, the leader's returns reach it
            total, n = return_total([e for e, w in zip(eps, which) if w == s])
            out[member.index] = total / n if n else math.nan
        return out

    def evaluate_held_out(self) -> tuple[float, dict]:
        """(Mean@k, its details) of the unperturbed weights on every rank (:meth:`HeldOut.evaluate`)."""
        out = self.held_out.evaluate()
        self._check_called()
        return out

    def _check_called(self) -> None:
        """After the first evaluation on every rank: a harness none of whose episodes called the endpoint stops
        the run on every rank, in one line (it was not pointed at the base URL it was given)."""
        if not self._checked:
            self._checked = True
            agree(self.player.dims, self.player.never_called)

    def take_failures(self) -> list[int]:
        return self.player.take_failures()

    def take_retried(self) -> list[int]:
        """[episodes played again, members evaluated again] on this rank since the last call (the player's)."""
        return self.player.take_retried()

    def take_trajectories(self) -> list:
        return []

    @property
    def recent_errors(self) -> list[str]:
        return self.player.recent_errors

    def close(self) -> None:
        if self.player.server is not None:
            self.player.server.close()


def build_harness(cfg, engine, dims, traj_path: str | None) -> HarnessObjective:
    """The harness objective of ``cfg`` (a TrainConfig) on ``engine``: the harness loaded (every rank, one line if
    it cannot be), an endpoint server started on each TP leader (every rank agrees on a failure)."""
    player = HarnessPlayer(cfg.objective, cfg.env, cfg.engine, cfg.run.seed, engine, dims, None,
                           _api_key(cfg), traj_path)
    error = None
    if dims.is_tp_leader:
        from esopt_mp.endpoint import EndpointServer

        try:
            server = EndpointServer(cfg.endpoint, engine.tokenizer, dp_rank=dims.dp_rank)
            server.start()
            player.server = server
        except Exception as e:  # noqa: BLE001 - a port in use, a missing extra: one line, on every rank
            error = f"{type(e).__name__}: {e}" if not isinstance(e, (RuntimeError, ValueError, OSError)) else str(e)
    try:
        agree(dims, error)
    except HarnessError:
        if player.server is not None:
            player.server.close()
        raise
    return HarnessObjective(player)


def _api_key(cfg) -> str:
    name = getattr(getattr(cfg, "endpoint", None), "api_key_env", "")
    return os.environ.get(name, "") if name else ""
