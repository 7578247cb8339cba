"""The embedded default's first ES steps against a checked-in ledger: a silent change of the numerics fails here.

The run is the README's main job (``python launch/train.py``, the embedded default) cut to its first steps: the
same composed config (its hash is pinned too), one process, the step called as the run calls it. What must match:
- the ledger's seeds, signs, sigma, alpha and returns exactly (greedy rollouts of a fixed model on fixed tasks:
  integers of correct cells over episodes, no float tolerance applies), the shaped weights to 1e-12 relative
  (z-scores of those returns, float64);
- per step, the squared norm of the weight change (the update), in float64, to 1e-3 relative. The change is read
  back from fp32 weights, each rounded to within 2**-24 of its size (about 1e-9 for this model's weights against
  updates near 1e-4, so <= 1e-5 relative per element); the rest covers another CPU's rounding of the noise. A
  wrong noise stream, a restore that leaves a trace or an update of other members changes it by O(1).
The returns of step 1 are played on the weights step 0 moved, so they check that update too.

Regenerate on purpose only (a deliberate change of the numerics, said in its commit):
    ESOPT_WRITE_GOLDEN=1 python -m pytest -q tests/integration/test_golden_ledger.py
"""
import json
import os
from pathlib import Path

import pytest

from esopt_mp.config import build_config

GOLDEN = Path(__file__).resolve().parent.parent / "fixtures" / "golden_default_ledger.json"
CONFIGS = Path(__file__).resolve().parent.parent.parent / "configs"
STEPS = 2
FIELDS = ("step", "seeds", "signs", "sigma", "alpha", "returns")


def _default_config(run_dir: str):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        raw = OmegaConf.to_container(compose("config", overrides=[f"run.dir={run_dir}"]), resolve=True)
    return build_config(raw, 1)


def _weights(trainer) -> dict:
    return {s.info.name: s.tensor.detach().double().clone() for s in trainer.perturber.shards}


def _run(tmp_path) -> dict:
    from esopt_mp.parallel import LaunchEnv, init_distributed
    from esopt_mp.trainer import ESTrainer

    cfg = _default_config(str(tmp_path / "run"))
    trainer = ESTrainer(cfg, init_distributed(LaunchEnv(0, 1, 0, "127.0.0.1", 0, "python"), 1, 1))
    try:
        norms = []
        for t in range(STEPS):
            before = _weights(trainer)
            trainer.step(t)
            after = _weights(trainer)
            norms.append(sum(float(((after[k] - before[k]) ** 2).sum()) for k in before))
        with open(trainer.ledger.path) as f:
            entries = [json.loads(line) for line in f]
    finally:
        trainer.close()
    return {"config_hash": trainer.config_hash, "update_sq_norms": norms,
            "entries": [{**{k: e[k] for k in FIELDS}, "weights": e["weights"]} for e in entries]}


def test_the_embedded_defaults_first_steps_match_the_checked_in_ledger(tmp_path):
    got = _run(tmp_path)
    if os.environ.get("ESOPT_WRITE_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps(got, indent=1) + "\n")
        pytest.skip(f"wrote {GOLDEN}")
    want = json.loads(GOLDEN.read_text())
    assert got["config_hash"] == want["config_hash"]
    assert len(got["entries"]) == len(want["entries"]) == STEPS
    for g, w in zip(got["entries"], want["entries"]):
        assert {k: g[k] for k in FIELDS} == {k: w[k] for k in FIELDS}, f"step {w['step']}"
        assert g["weights"] == pytest.approx(w["weights"], rel=1e-12, abs=1e-12), f"step {w['step']}"
    assert got["update_sq_norms"] == pytest.approx(want["update_sq_norms"], rel=1e-3)
    assert all(n > 0 for n in want["update_sq_norms"])  # the steps moved the weights: the norms check something
