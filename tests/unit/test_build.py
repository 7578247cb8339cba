"""The one builder: every objective kind, trainer and engine is registered once, and both engines' weights answer
the same weight-operations interface."""
import inspect

import pytest
import torch

from esopt_mp.build import OBJECTIVE_KINDS, build_objective
from esopt_mp.config import build_config
from esopt_mp.objectives import EPISODIC, IN_PROCESS, SERVED
from esopt_mp.es import Perturber, WeightOps, build_local_shards
from esopt_mp.es.weight_ops import OPS


def test_every_objective_name_has_one_kind_and_those_with_tasks_are_the_episodic_ones():
    from esopt_mp.objectives import OBJECTIVES

    assert set(OBJECTIVE_KINDS) == set(OBJECTIVES)
    assert {name for name, kind in OBJECTIVE_KINDS.items() if kind.tasks is not None} == set(EPISODIC)
    assert sorted(IN_PROCESS + SERVED) == sorted(EPISODIC)  # every episodic kind plays one way, and only one


def test_every_algorithm_has_one_trainer_and_it_is_a_class():
    import importlib

    from esopt_mp.config import ALGOS
    from esopt_mp.runner import TRAINERS

    assert set(TRAINERS) == set(ALGOS)
    for algo, target in TRAINERS.items():
        module, _, cls = target.partition(":")
        assert inspect.isclass(getattr(importlib.import_module(module), cls)), algo


def test_both_engines_weights_declare_every_weight_operation():
    from esopt_mp.engine.vllm import VLLMWeights  # imports without vLLM: it is loaded in build_vllm

    declared = {n for n in vars(WeightOps) if not n.startswith("_")}
    assert declared == set(OPS)  # the tuple the checks below walk is the protocol's members
    missing = [op for op in OPS if not hasattr(VLLMWeights, op)]  # a class: its instances need a vLLM engine
    assert not missing, missing
    perturber = Perturber(build_local_shards(torch.nn.Sequential(torch.nn.Linear(4, 3))))
    assert isinstance(perturber, WeightOps) and all(hasattr(perturber, op) for op in OPS)


def test_an_episodeless_objective_is_built_on_the_model_and_has_no_engine():
    cfg = build_config({"objective": {"name": "seed_hash"}}, 1)
    built = build_objective(cfg, None, "unused", model=torch.nn.Linear(2, 2))
    assert built.engine is None and built.context is None
    assert type(built.objective).__name__ == "SeedHash"


def test_the_dry_run_reads_the_kind_s_tasks_and_checks(tmp_path):
    from esopt_mp.startup import dry_run

    cfg = build_config({"run": {"dir": str(tmp_path / "run")}, "objective": {"name": "agent"},
                        "model": {"path": "builtin:tiny_agent"}, "env": {"name": "sudoku"}}, 1)
    lines = dry_run(cfg, 1)
    assert "env: sudoku start-up check passed" in lines
    train, held = OBJECTIVE_KINDS["agent"].tasks(cfg)
    assert f"tasks: {len(train)} training, {len(held)} held-out" in lines
    with pytest.raises(KeyError):
        OBJECTIVE_KINDS["nope"]
