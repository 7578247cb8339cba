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


def test_a_component_refuses_a_setting_in_the_words_of_the_config(tmp_path):
    """Each setting is checked by one function: the component called directly and the config say the same line."""
    import torch

    from esopt_mp.engine.base import SamplingParams
    from esopt_mp.es.perturber import Perturber
    from esopt_mp.es.seeds import Schedule
    from esopt_mp.es.shaping import shape_returns
    from esopt_mp.models.loading import load_model
    from esopt_mp.parallel.dims import ParallelDims
    from esopt_mp.es.shard import LocalShard, ShardInfo

    shard = [LocalShard(torch.zeros(4), ShardInfo.full("w", (4,)))]
    cases = [
        (lambda: Perturber(shard, restore="undo"), {"es": {"restore": "undo"}}),
        (lambda: Perturber(shard, master="fp64"), {"es": {"master": "fp64"}}),
        (lambda: Schedule("step", 1e-3, 1e-3, 10), {"es": {"sigma": {"kind": "step"}}}),  # sigma's or alpha's
        (lambda: shape_returns([1.0, 2.0], "rank"), {"es": {"shaping": "rank"}}),
        (lambda: SamplingParams(top_p=0.0), {"engine": {"top_p": 0.0}}),
        (lambda: ParallelDims(0, 1, 0), {"parallel": {"dp": 0}}),
        (lambda: load_model(str(tmp_path), ParallelDims(1, 1, 1), "int8"), {"model": {"dtype": "int8"}}),
    ]
    for component, data in cases:
        with pytest.raises(ValueError) as direct:
            component()
        with pytest.raises(ConfigError) as config:
            build_config(data)
        assert str(direct.value) == str(config.value).replace("es.sigma.", "schedule.")
