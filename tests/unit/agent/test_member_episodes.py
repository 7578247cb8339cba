"""Which tasks and sampling seeds a member's training episodes get: the step's tasks for every member, and the
draws each member's own, or with env.common_draws the same for every member (ES); the baselines draw the same
tasks as ES's members."""
from types import SimpleNamespace

from esopt_mp.agent.episodes import EpisodeTally, draw_step_tasks, step_task_indices
from esopt_mp.envs.config import EnvConfig


class Player(EpisodeTally):
    def __init__(self, common: bool):
        super().__init__()
        self.cfg = EnvConfig(episodes_per_step=3, n_train=10, common_draws=common)
        self.run_seed, self.train_tasks = 7, [{"id": i} for i in range(10)]

    def step_tasks(self, step):
        return draw_step_tasks(self.train_tasks, self.run_seed, step, self.cfg.episodes_per_step)


def _member(step, index):
    return SimpleNamespace(step=step, index=index)


def test_members_share_tasks_and_draw_their_own_seeds_unless_draws_are_common():
    own, common = Player(False), Player(True)
    t0, s0 = own.member_episodes(_member(2, 0))
    t1, s1 = own.member_episodes(_member(2, 1))
    assert t0 == t1 and len(set(s0)) == 3 and not set(s0) & set(s1)
    c0, c1 = common.member_episodes(_member(2, 0)), common.member_episodes(_member(2, 1))
    assert c0 == c1 and c0[0] == t0 and len(set(c0[1])) == 3 and not set(c0[1]) & set(s0)
    assert common.member_episodes(_member(3, 0))[1] != c0[1]  # another step, other draws
    assert [t["id"] for t in t0] == step_task_indices(10, 7, 2, 3)  # the baselines' draw is the same


def test_common_draws_are_in_the_config_hash_only_when_set():
    from esopt_mp.config import build_config
    from esopt_mp.identity import config_hash

    sampled = {"engine": {"temperature": 0.7}, "objective": {"name": "agent"}}
    base = config_hash(build_config(sampled), None)
    assert config_hash(build_config({**sampled, "env": {"common_draws": False}}), None) == base  # earlier runs' hash
    assert config_hash(build_config({**sampled, "env": {"common_draws": True}}), None) != base


def test_common_draws_are_refused_where_nothing_would_use_them():
    import pytest

    from esopt_mp.config import build_config
    from esopt_mp.typed import ConfigError

    with pytest.raises(ConfigError, match="env.common_draws: greedy training episodes"):
        build_config({"env": {"common_draws": True}, "engine": {"temperature": 0.0}, "objective": {"name": "agent"}})
    with pytest.raises(ConfigError, match="env.common_draws: ES members' episode draws: needs algo=es"):
        build_config({"env": {"common_draws": True}, "engine": {"temperature": 0.7}, "algo": {"name": "grpo"}})
