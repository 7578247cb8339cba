"""The config hash covers what determines the weights, by content, and nothing else."""
import shutil

import pytest

from esopt_mp.config import build_config
from esopt_mp.identity import config_hash, model_fingerprint
from esopt_mp.models import build_tiny_qwen35


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_qwen35(str(tmp_path_factory.mktemp("m") / "tiny"), seed=3, num_hidden_layers=2)


def _tasks(path, text):
    path.write_text(text)
    return str(path)


def test_layout_eval_run_and_paths_do_not_change_the_hash(tmp_path, model_dir):
    copy = str(tmp_path / "elsewhere")
    shutil.copytree(model_dir, copy)
    train = _tasks(tmp_path / "train.jsonl", '{"puzzle": "1..."}\n')
    train2 = _tasks(tmp_path / "other_mount.jsonl", '{"puzzle": "1..."}\n')
    ev = _tasks(tmp_path / "eval.jsonl", '{"puzzle": "2..."}\n')
    base = build_config({"model": {"path": model_dir}, "env": {"train_path": train, "n_train": 1,
                                                                 "episodes_per_step": 1}})
    same = build_config({"model": {"path": copy}, "parallel": {"dp": 4, "tp": 2, "checksum_every": 0},
                         "run": {"dir": "/x", "keep_checkpoints": 0},
                         "env": {"train_path": train2, "eval_path": ev, "n_eval": 3, "eval_repeats": 4,
                                 "eval_temperature": 0.5, "n_train": 1, "episodes_per_step": 1,
                                 "sandbox": {"level": "rlimit", "min_level": "rlimit"}},
                         "es": {"chunk_elems": 4096, "noise_backend": "compile"}})
    assert config_hash(base) == config_hash(same) == config_hash(base, copy)


@pytest.mark.parametrize("override", [
    {"run": {"seed": 1}}, {"es": {"population": 4}}, {"es": {"restore": "subtract"}}, {"es": {"master": "fp32_host"}},
    {"es": {"exclude": ["*norm*"]}}, {"es": {"sigma": {"start": 0.5}}}, {"model": {"dtype": "bfloat16"}},
    {"env": {"max_turns": 9}}, {"env": {"sudoku": {"mask_count": 5}}}, {"env": {"sudoku": {"hints": True}}}, {"env": {"episodes_per_step": 2}},
    {"env": {"task_seed": 1}}, {"engine": {"temperature": 1.0}}, {"objective": {"batch": 2}},
    {"env": {"sandbox": {"wall_s": 5.0}}}, {"es": {"noise": "lowrank"}},
])
def test_what_shapes_the_weights_changes_the_hash(override, model_dir):
    base = {"model": {"path": model_dir}}
    data = {**base, **{k: {**base.get(k, {}), **v} for k, v in override.items()}}
    assert config_hash(build_config(data)) != config_hash(build_config(base))


def test_model_and_task_content_change_the_hash(tmp_path, model_dir):
    other = build_tiny_qwen35(str(tmp_path / "other"), seed=4, num_hidden_layers=2)  # same shapes, other weights
    assert model_fingerprint(other) != model_fingerprint(model_dir)
    assert (config_hash(build_config({"model": {"path": other}}))
            != config_hash(build_config({"model": {"path": model_dir}})))
    a = _tasks(tmp_path / "a.jsonl", '{"puzzle": "1..."}\n')
    b = _tasks(tmp_path / "b.jsonl", '{"puzzle": "3..."}\n')
    cfg = lambda p: build_config({"env": {"train_path": p, "n_train": 1, "episodes_per_step": 1}})  # noqa: E731
    assert config_hash(cfg(a)) != config_hash(cfg(b))


def test_keep_checkpoints_is_validated():
    from esopt_mp.config import ConfigError

    with pytest.raises(ConfigError, match="run.keep_checkpoints: must be >= 0"):
        build_config({"run": {"keep_checkpoints": -1}})


def test_vllm_serving_settings_stay_out_of_the_hash_and_old_runs_keep_theirs():
    from esopt_mp.config import build_config

    def h(**engine):
        return config_hash(build_config({"objective": {"name": "agent"}, "engine": {"name": "vllm", **engine}}), None)

    base = h()
    for key, value in (("weight_sync", "reload"), ("kv_cache_gib", 2.0), ("gpu_memory_utilization", 0.5),
                       ("enforce_eager", False), ("max_model_len", 8192), ("prefix_reuse", False)):
        assert h(**{key: value}) == base, key
    assert h(temperature=0.3) != base  # rollouts differ
    # the embedded default's hash as runs started before engine=vllm recorded it: their resume still works
    assert config_hash(build_config({}), None) == "c999d5ed83fd066a"


def test_the_noise_mode_and_its_rank_are_in_the_hash_only_where_they_act(model_dir):
    def h(**es):
        return config_hash(build_config({"model": {"path": model_dir}, "es": es}))

    assert h(rank=4) == h()  # full-rank noise has no rank: runs from before es.noise keep their hash
    assert len({h(), h(noise="lowrank"), h(noise="lowrank", rank=4)}) == 3
    for bad, line in (({"noise": "sparse"}, "es.noise"), ({"rank": 0}, "es.rank"), ({"rank": 65}, "es.rank")):
        with pytest.raises(ValueError, match=line):
            build_config({"es": bad})
