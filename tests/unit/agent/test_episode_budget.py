"""The per-trajectory token budget (env.max_episode_tokens): turns capped to what is left, episodes ended."""
import json
import types

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from esopt_mp.chat.format import opening_text
from esopt_mp.agent.loop import AgentConfig, run_episodes, write_trajectories
from esopt_mp.config import ConfigError, build_config
from esopt_mp.engine.hf import HFEngine
from esopt_mp.engine.base import SamplingParams
from esopt_mp.engine.tp import TPEngine
from esopt_mp.envs import make
from esopt_mp.envs.sudoku import generate
from esopt_mp.identity import config_hash
from esopt_mp.models.tiny import build_tiny_agent_base
from tests.fixtures.tp_pair import RecordedTpPair

TURN = 10  # max_new_tokens per turn


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    torch.set_num_threads(1)
    path = build_tiny_agent_base(str(tmp_path_factory.mktemp("agent") / "base"))
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _cfg(budget, temperature=0.0):
    kw = {} if budget is None else {"max_episode_tokens": budget}  # None: AgentConfig's default
    return AgentConfig(max_turns=4, sampling=SamplingParams(temperature=temperature, max_new_tokens=TURN), **kw)


def _play(agent, budget, n=3, temperature=0.0, dims=None):
    model, tok = agent
    tasks = generate(n, 4, size=4, seed=7)
    envs = [make("sudoku", max_turns=4) for _ in tasks]
    engine, cfg = TPEngine(HFEngine(model, tok), dims), _cfg(budget, temperature)
    return engine.lead(lambda: run_episodes(engine, envs, tasks, list(range(n)), cfg), cfg.sampling)


def _opening_tokens(tok, task) -> int:
    msgs, _ = make("sudoku", max_turns=4).reset(task)
    return len(tok.encode(opening_text(msgs), add_special_tokens=False))


def test_budget_zero_and_an_unreachable_budget_change_nothing(agent):
    free, zero, huge = _play(agent, None), _play(agent, 0), _play(agent, 10**6)
    assert AgentConfig().max_episode_tokens == 0
    assert [e.token_ids for e in free] == [e.token_ids for e in zero] == [e.token_ids for e in huge]
    assert [e.ended for e in zero] == [e.ended for e in huge] == ["truncated"] * 3  # sudoku's own turn limit
    assert all(len(e.turns) == 4 for e in zero)


def test_a_tiny_budget_caps_the_last_turn_and_ends_the_episode(agent, tmp_path):
    model, tok = agent
    task = generate(1, 4, size=4, seed=7)[0]
    free = _play(agent, 0, n=1)[0]
    first_prompt = free.turns[0]["prompt_tokens"]
    second_prompt = free.turns[1]["prompt_tokens"]
    assert first_prompt == _opening_tokens(tok, task) and free.turns[0]["response_tokens"] == TURN
    budget = first_prompt + TURN + second_prompt + 3  # room for 3 tokens in turn 2, none in turn 3
    ep = _play(agent, budget, n=1)[0]
    assert ep.ended == "token_budget" and len(ep.turns) == 2 and ep.error is None
    assert [t["response_tokens"] for t in ep.turns] == [TURN, 3] and ep.turns[1]["finish"] == "length"
    assert len(ep.token_ids) == budget  # prompt + generated tokens: exactly the budget, never more
    assert ep.token_ids == free.token_ids[:budget]  # the same stream, cut where the budget ends
    assert ep.ret == ep.turns[-1]["reward"]  # scored as the env scores an unfinished episode
    write_trajectories(tmp_path / "t.jsonl", [ep], step=0)
    row = json.loads((tmp_path / "t.jsonl").read_text())
    assert row["ended"] == "token_budget" and len(row["turns"]) == 2


def test_a_budget_below_the_opening_prompt_ends_before_any_turn(agent):
    model, tok = agent
    task = generate(1, 4, size=4, seed=7)[0]
    ep = _play(agent, _opening_tokens(tok, task), n=1)[0]  # the prompt fills it: nothing left to generate
    assert (ep.ended, ep.ret, ep.turns, ep.error) == ("token_budget", 0.0, [], None)


def test_bad_budgets_are_refused_naming_the_key(agent):
    with pytest.raises(ConfigError, match="env.max_episode_tokens: must be >= 0"):
        build_config({"env": {"max_episode_tokens": -1}})
    with pytest.raises(ConfigError, match="env.max_episode_tokens: expected an integer"):
        build_config({"env": {"max_episode_tokens": "32k"}})
    with pytest.raises(ValueError, match="max_episode_tokens"):
        AgentConfig(max_episode_tokens=-5)
    model, tok = agent
    eng = HFEngine(model, tok)
    convs = [eng.new_conversation(0, 0)]
    with pytest.raises(ValueError, match="max_new"):
        eng.generate(convs, [[1, 2]], SamplingParams(max_new_tokens=4), max_new=[0])


def test_the_budget_is_in_the_config_hash_only_when_set():
    assert config_hash(build_config({"env": {"max_episode_tokens": 0}}), None) == "c999d5ed83fd066a"
    assert config_hash(build_config({"env": {"max_episode_tokens": 4096}}), None) != "c999d5ed83fd066a"


def _dims(rank, comm):
    return types.SimpleNamespace(distributed=True, tp=2, rank=rank, tp_rank=rank, comm=comm)


def test_a_tp_follower_takes_the_leaders_budget_decisions(agent):
    model, tok = agent
    t = _play(agent, 0, n=1, temperature=1.0)[0].turns
    budget = t[0]["prompt_tokens"] + t[0]["response_tokens"] + t[1]["prompt_tokens"] + 3  # turn 2 of episode 0: 3
    leader = RecordedTpPair()
    eps = _play(agent, budget, temperature=1.0, dims=_dims(0, leader))
    assert {e.ended for e in eps} == {"token_budget"}
    caps = [m[3] for m in leader.log["msgs"] if m[0] == "gen"]  # the caps travel with each turn
    assert all(c is not None for c in caps) and min(min(c) for c in caps) == 3
    ids = TPEngine(HFEngine(model, tok), _dims(1, RecordedTpPair(leader.log))).follow(_cfg(budget, temperature=1.0).sampling)
    assert ids == [e.token_ids for e in eps]
