import pytest

from esopt_mp.config import ConfigError, TrainConfig, build_config


def test_defaults_validate_and_hash_ignores_run_section():
    a = build_config({})
    b = build_config({"run": {"dir": "/elsewhere"}})
    assert isinstance(a, TrainConfig) and a.hash() == b.hash()
    assert build_config({"es": {"seed": 1}}).hash() != a.hash()


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
