import pytest

from esopt_mp.config import ConfigError, TrainConfig, build_config
from esopt_mp.identity import config_hash


def test_defaults_validate_and_hash_ignores_run_section():
    a = build_config({})
    b = build_config({"run": {"dir": "/elsewhere"}})
    assert isinstance(a, TrainConfig) and config_hash(a) == config_hash(b)
    assert config_hash(build_config({"run": {"seed": 1}})) != config_hash(a)


@pytest.mark.parametrize("data,match", [
    ({"es": {"populaton": 8}}, "unknown config key 'es.populaton'"),
    ({"bogus": 1}, "unknown config key 'bogus'"),
    ({"es": {"sigma": {"start": 0.0}}}, "es.sigma.start: a training schedule needs sigma > 0"),
    ({"es": {"sigma": {"start": -1.0}}}, "es.sigma.start: must be finite"),
    ({"es": {"population": 7}}, "even population"),
    ({"es": {"population": "8"}}, "es.population: expected an integer"),
    ({"es": {"restore": "undo"}}, "es.restore"),
    ({"es": {"mirrored": "yes"}}, "es.mirrored: expected true/false"),
    ({"parallel": {"dp": 4}, "es": {"population": 2}}, "smaller than parallel.dp=4"),
    ({"objective": {"name": "chess"}}, "objective.name: unknown objective 'chess'"),
    ({"model": {"dtype": "int8"}}, "model.dtype"),
])
def test_bad_configs_name_the_key(data, match):
    with pytest.raises(ConfigError, match=match):
        build_config(data)


def test_world_size_mismatch():
    with pytest.raises(ConfigError, match=r"2 \* 2 = 4 != 2"):
        build_config({"parallel": {"dp": 2, "tp": 2}, "es": {"population": 8}}, world_size=2)


def test_episode_wall_clock_and_env_workers_are_validated_and_out_of_the_hash():
    import pytest

    from esopt_mp.config import ConfigError, build_config

    with pytest.raises(ConfigError, match=r"env\.episode_timeout_s: must be > 0, got 0"):
        build_config({"env": {"episode_timeout_s": 0}})
    with pytest.raises(ConfigError, match=r"env\.env_workers: must be in \[0, 64\]"):
        build_config({"env": {"env_workers": 1000}})
    cfg = build_config({"env": {"episode_timeout_s": 3600, "env_workers": 4}})
    assert (cfg.env.episode_timeout_s, cfg.env.env_workers) == (3600, 4)
    assert config_hash(cfg, None) == config_hash(build_config({}), None)  # a requeue on other hardware may change them
