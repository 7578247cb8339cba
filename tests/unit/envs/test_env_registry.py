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


def _dist(root, dist: str, entries: str, modules: dict[str, str] | None = None) -> str:
    """An installed distribution (a dist-info declaring ``entries`` in the plugins' group) in a folder of its own."""
    info = root / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{registry.GROUP}]\n{entries}\n")
    for name, src in (modules or {}).items():
        (root / f"{name}.py").write_text(src)
    return str(root)


def _game(tag: str) -> str:
    return ("class Env:\n    @classmethod\n    def tasks(cls, split, n, seed):\n"
            f"        return [{{'id': f'{tag}-{{split}}{{i}}'}} for i in range(n)]\n")


@pytest.mark.parametrize("first", ["alpha", "beta"])
def test_two_distributions_declaring_one_name_warn_naming_both_and_the_first_on_sys_path_is_used(
        tmp_path, monkeypatch, caplog, first):
    for tag in ("alpha", "beta"):
        _dist(tmp_path / tag, f"{tag}-plugin", f"twin = twin_{tag}_{first}:Env", {f"twin_{tag}_{first}": _game(tag)})
    second = "beta" if first == "alpha" else "alpha"
    monkeypatch.syspath_prepend(str(tmp_path / second))
    monkeypatch.syspath_prepend(str(tmp_path / first))  # first on sys.path
    monkeypatch.setattr(registry, "_SPECS", {})
    assert registry.names()[1].count("twin") == 1
    assert registry.duplicates()["twin"] == [{"distribution": f"{n}-plugin", "target": f"twin_{n}_{first}:Env"}
                                             for n in (first, second)]
    with caplog.at_level("WARNING", logger="esopt_mp.envs.registry"):
        spec = registry.load_spec("twin")
        registry.load_spec("twin")  # said once
    assert spec.tasks(spec.config(), "train", 1, 0) == [{"id": f"{first}-train0"}]
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning == (f"environment 'twin' is declared by 2 installed distributions, {first}-plugin "
                       f"(twin_{first}_{first}:Env), {second}-plugin (twin_{second}_{first}:Env): using "
                       f"{first}-plugin's, the first on sys.path; to use another, uninstall {first}-plugin or give an "
                       "entry point another name")
    shown = registry.describe("twin")
    assert (shown["distribution"], shown["not_used"]) == (f"{first}-plugin", [f"{second}-plugin: "
                                                                             f"twin_{second}_{first}:Env"])


def test_a_plugin_with_a_builtins_name_is_not_used_and_the_warning_names_its_distribution(tmp_path, monkeypatch,
                                                                                          caplog):
    monkeypatch.syspath_prepend(_dist(tmp_path, "shadow-plugin", "math_react = shadow_mod:Env"))
    monkeypatch.setattr(registry, "_SPECS", {})
    with caplog.at_level("WARNING", logger="esopt_mp.envs.registry"):
        spec = registry.load_spec("math_react")
    assert not isinstance(spec, FactorySpec)  # the built-in's SPEC
    assert [r.getMessage() for r in caplog.records] == [
        "environment 'math_react': the built-in is used; installed plugin shadow_mod:Env (distribution shadow-plugin) "
        "declares the same name and cannot be used: rename its entry point"]


BROKEN = '''
import dataclasses


@dataclasses.dataclass
class Section:
    level: int = 1

    def validate(self, key):
        if self.level == 3:
            raise {}["level"]  # a bug in the plugin, not a refusal
        if self.level < 0:
            raise ValueError(f"{key}.level: must be >= 0, got {self.level}")


class Env:
    config = Section

    @classmethod
    def tasks(cls, split, n, seed, level=1):
        if level == 1:
            raise RuntimeError("the dataset server is down\\n(retry later)")
        return [{"id": i} for i in range(n)]

    @staticmethod
    def task_key(task):
        raise KeyError("q")
'''


def test_a_plugins_code_raising_at_start_up_is_one_line_naming_the_plugin(tmp_path, monkeypatch):
    """What start-up calls of a plugin (its tasks, task_key, section validate) raising: a ValueError, the one line
    the trainer, the dry run and ``python -m esopt_mp.envs check`` report, naming the entry point and distribution."""
    monkeypatch.syspath_prepend(_dist(tmp_path, "broken-tasks", "brokentasks = brokentasks_mod:Env",
                                      {"brokentasks_mod": BROKEN}))
    monkeypatch.setattr(registry, "_SPECS", {})
    spec = registry.load_spec("brokentasks")
    where = "of plugin brokentasks_mod:Env (distribution broken-tasks) raised"
    cfg = EnvConfig(name="brokentasks", n_train=2, n_eval=1, episodes_per_step=1)
    with pytest.raises(ValueError) as e:
        spec.splits(cfg, spec.config())
    assert str(e.value) == (f"environment 'brokentasks': tasks('train', 2, 0) {where} RuntimeError: the dataset "
                            "server is down (retry later)")
    with pytest.raises(ValueError) as e:
        spec.splits(cfg, spec.config(level=2))
    assert str(e.value) == f"environment 'brokentasks': task_key() {where} KeyError: 'q'"
    with pytest.raises(ValueError) as e:
        spec.validate(spec.config(level=3), cfg, "env.brokentasks")
    assert str(e.value) == f"environment 'brokentasks': env.brokentasks's validate() {where} KeyError: 'level'"
    with pytest.raises(ValueError, match=r"^env.brokentasks.level: must be >= 0, got -1$"):  # its own refusal
        spec.validate(spec.config(level=-1), cfg, "env.brokentasks")
