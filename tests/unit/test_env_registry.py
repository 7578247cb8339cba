"""The registry and the env sections in the ways users get them wrong: misspelt sections, untyped keys, factories
the runtime cannot build, tasks it cannot record, rewards it cannot rank, plugins that collide with names."""
import dataclasses
import math

import pytest

from esopt_mp.agent.loop import AgentConfig, run_episodes
from esopt_mp.config import ConfigError, build_config, open_sections
from esopt_mp.envs.config import EnvConfig
from esopt_mp.envs import registry
from esopt_mp.envs.registry import EnvNotFound, FactorySpec, build_section
from tests.web.scripted import ScriptedEngine


def test_a_misspelt_section_is_refused_not_ignored():
    with pytest.raises(ConfigError, match=r"env.sudok: no environment is named 'sudok' \(a misspelt section\?\)"):
        build_config({"env": {"name": "sudoku", "sudok": {"size": 9}}})
    # another known environment's section (an env group's defaults) is kept aside, not refused
    assert build_config({"env": {"name": "math_react", "sudoku": {"size": 9}}}).env.name == "math_react"


def test_a_scalar_for_a_section_and_a_shared_key_as_a_name_are_one_line():
    with pytest.raises(ConfigError, match=r"env.my_env=5: an environment's section takes keys, env.my_env.<key>"):
        open_sections(["env.my_env=5"])
    with pytest.raises(ConfigError, match=r"env.name: 'sandbox' is a key every environment shares"):
        build_config({"env": {"name": "sandbox"}})


class Game:
    def __init__(self, max_turns=2, words=["a", "b"], weights={"a": 1.0}, level: int = 1):  # noqa: B006
        self.max_turns, self.words, self.weights, self.level = max_turns, words, weights, level

    @classmethod
    def tasks(cls, split, n, seed, level=1):
        return [{"id": f"{split}{seed}-{i}", "level": level, "q": i % 2} for i in range(n)]


def test_a_section_derived_from_the_factory_checks_list_and_dict_keys_and_merges_dict_defaults():
    spec = FactorySpec("game", Game)
    assert [f.name for f in dataclasses.fields(spec.config)] == ["words", "weights", "level"]
    with pytest.raises(ConfigError, match=r"env.game.words: expected a list, got 'foo'"):
        build_section(spec, {"words": "foo"}, "env.game")
    with pytest.raises(ConfigError, match=r"env.game.weights: expected a mapping"):
        build_section(spec, {"weights": "foo"}, "env.game")
    with pytest.raises(ConfigError, match=r"env.game.level: expected an integer"):
        build_section(spec, {"level": "high"}, "env.game")
    assert build_section(spec, {"weights": {"x": 5}}, "env.game").weights == {"a": 1.0, "x": 5}  # added to
    env = spec.build(build_section(spec, {"level": 3}, "env.game"), max_turns=4)
    assert (env.max_turns, env.level, env.words) == (4, 3, ["a", "b"])


def test_too_few_tasks_say_why():
    spec = FactorySpec("game", type("Same", (Game,), {"task_key": staticmethod(lambda t: str(t["q"]))}))
    cfg = EnvConfig(name="x", n_train=4, n_eval=2, episodes_per_step=2)
    with pytest.raises(ValueError, match=r"4 training tasks .* and 0 held-out tasks \(of 4 drawn, those equal to a "
                                         r"training task by its task_key dropped"):
        spec.splits(cfg, spec.config())
    train, held = FactorySpec("game", Game).splits(cfg, spec.config())  # by the whole task: none repeat
    assert len(train) == 4 and len(held) == 2


@pytest.mark.parametrize("attrs,why", [
    ({"returns": "Sum"}, "returns must be 'last' or 'sum', got 'Sum'"),
    ({"__init__": lambda self, level, max_turns=2: None}, "takes level without a default"),
])
def test_a_factory_the_runtime_cannot_build_is_refused_when_loaded(attrs, why):
    with pytest.raises(EnvNotFound, match=why):
        FactorySpec("bad", type("Bad", (Game,), attrs))


def test_tasks_that_are_not_json_are_refused():
    nan = type("Nan", (Game,), {"tasks": classmethod(lambda cls, split, n, seed: [{"x": math.nan}] * n)})
    obj = type("Obj", (Game,), {"tasks": classmethod(lambda cls, split, n, seed: [{"x": {1, 2}}] * n)})
    for factory in (nan, obj):
        with pytest.raises(ValueError, match=r"tasks\('train', ...\) are not JSON"):
            FactorySpec("bad", factory).tasks(FactorySpec("bad", factory).config(), "train", 2, 0)


class NaNReward:
    max_turns = 1
    failure_return = -1.0

    def reset(self, task):
        return [{"role": "user", "content": "go"}], {}

    def step(self, text):
        return [], math.nan, True, False, {}


def test_a_reward_that_is_not_finite_is_the_models_failure_and_counted():
    ep = run_episodes(ScriptedEngine([["a"]]), [NaNReward()], [{"id": "n"}], [0], AgentConfig(max_turns=1))[0]
    assert ep.failure == "model" and ep.ret == -1.0 and "reward is nan" in ep.error


def test_a_library_older_than_the_adapter_needs_is_named_with_its_version():
    spec = FactorySpec("old", type("Old", (Game,), {"requires": {"json": "pytest>=999"}, "extra": "old"}))
    why = registry.missing_requirements(spec)
    assert why.startswith("environment 'old' needs pytest>=999 (installed: ") and "esopt_mp[old]" in why


@pytest.mark.parametrize("name,module,requirement", [
    ("reasoning_gym", "reasoning_gym", "reasoning-gym>=0.1.23"), ("textarena", "textarena", "textarena>=0.7.4"),
    ("gem", "gem", "gem-llm>=0.1.0"), ("gymnasium", "gymnasium", "gymnasium>=1.0"),
    ("openenv", "openenv", "openenv-core>=0.3.0")])
def test_a_library_adapter_without_its_library_is_one_line_naming_its_extra(monkeypatch, name, module, requirement):
    """The adapters import their library only when used: without it, validation names the pip install to run
    (whether the library is installed here or not)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == module else real(m, *a))
    spec = registry.load_spec(name)
    with pytest.raises(ConfigError) as e:
        build_config({"env": {"name": name}})
    assert str(e.value) == (f"env.{name}: environment {name!r} needs {requirement} (not installed): pip install "
                            f"'esopt_mp[{name}]' (from a source checkout: pip install -e '.[{name}]')")
    assert spec.requires == {module: requirement} and spec.extra == name
