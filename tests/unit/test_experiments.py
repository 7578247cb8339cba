import os

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from esopt_mp.config import ConfigError, build_config

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")


def _compose(*overrides):
    with initialize_config_dir(config_dir=os.path.abspath(CONFIGS), version_base="1.3"):
        return OmegaConf.to_container(compose("config", overrides=list(overrides)), resolve=True)


def test_embedded_default_composes():
    cfg = build_config(_compose(), 1)
    assert cfg.model.path == "builtin:tiny_agent" and cfg.objective.name == "agent" and cfg.env.hints
    fast = build_config(_compose("model=tiny", "objective=target_logprob"), 1)
    assert fast.model.path is None and fast.objective.name == "target_logprob"
    assert os.path.isfile(os.path.join(os.path.dirname(__file__), "..", "..", "esopt_mp", "assets", "tiny_agent",
                                       "model.safetensors"))


@pytest.mark.parametrize("name,env,population", [("sudoku_4b", "sudoku", 32), ("sudoku_4b_h10", "sudoku", 32),
                                                 ("sudoku_4b_h15", "sudoku", 32), ("math_4b", "math_react", 16),
                                                 ("ahd_bpp", "heuristic", 16)])
def test_experiment_profiles(name, env, population, monkeypatch, tmp_path):
    data = tmp_path / "data"
    for sub in ("sudoku/train.jsonl", "sudoku/eval.jsonl", "math/dapo_evolve.jsonl", "math/dapo_test.jsonl"):
        (data / sub).parent.mkdir(parents=True, exist_ok=True)
        (data / sub).write_text("")
    monkeypatch.setenv("ESOPT_DATA", str(data))
    cfg = build_config(_compose(f"+experiment={name}"), 1)
    assert (cfg.env.name, cfg.es.population, cfg.model.dtype, cfg.es.master) == (env, population, "bfloat16", "fp32_host")
    if name.startswith("sudoku"):
        hstar = {"sudoku_4b": 5, "sudoku_4b_h10": 10, "sudoku_4b_h15": 15}[name]
        assert (cfg.env.mask_count, cfg.env.max_turns) == (hstar, 3 * hstar)
        assert cfg.es.sigma.start == (7e-4 if hstar == 15 else 1e-3)


def test_webarena_profile_says_what_is_missing():
    with pytest.raises(ConfigError, match="unknown environment 'webarena_lite'"):
        build_config(_compose("+experiment=webarena_27b"), 4)
