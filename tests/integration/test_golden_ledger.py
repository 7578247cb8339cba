"""The embedded default's first ES steps against a checked-in ledger: a silent change of the numerics fails here.

The run is the README's main job (``python launch/train.py``, the embedded default) cut to its first steps: the
same composed config (its hash is pinned too), one process, the step called as the run calls it. What must match:
- the ledger's seeds, signs, sigma, alpha and returns exactly (greedy rollouts of a fixed model on fixed tasks:
  integers of correct cells over episodes, no float tolerance applies), the shaped weights to 1e-12 relative
  (z-scores of those returns, float64);
- per step and tensor, the weight change (the update) at 8 spread positions. It is read back from fp32 weights:
  the stored weight is rounded to within one ulp of its size (2**-23 |w|), and another CPU may round the noise
  itself by a few ulps of the change; so each element must agree to 2**-22 |w| + 2**-19 |change|, about 1e-8
  here against changes near 1e-3. A wrong noise stream, a restore that leaves a trace or an update of other
  members moves the elements by their own size.
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
STEPS = 2
FIELDS = ("step", "seeds", "signs", "sigma", "alpha", "returns")


def _default_config(run_dir: str):
    from tests.fixtures.configs import compose_config

    return build_config(compose_config(f"run.dir={run_dir}"), 1)


def _weights(trainer) -> dict:
    return {s.info.name: s.tensor.detach().double().flatten().clone() for s in trainer.perturber.shards}


def _samples(before: dict, after: dict) -> dict:
    """{tensor: [[change, weight after], ...]} at 8 positions spread over each tensor (first and last included)."""
    out = {}
    for k in sorted(before):
        n = before[k].numel()
        idx = sorted({round(i * (n - 1) / 7) for i in range(8)})
        out[k] = [[float(after[k][i] - before[k][i]), float(after[k][i])] for i in idx]
    return out


def _run(tmp_path) -> dict:
    from esopt_mp.parallel import LaunchEnv, init_distributed
    from esopt_mp.trainer import ESTrainer

    cfg = _default_config(str(tmp_path / "run"))
    trainer = ESTrainer(cfg, init_distributed(LaunchEnv(0, 1, 0, "127.0.0.1", 0, "python"), 1, 1))
    try:
        updates = []
        for t in range(STEPS):
            before = _weights(trainer)
            trainer.step(t)
            updates.append(_samples(before, _weights(trainer)))
        with open(trainer.ledger.path) as f:
            entries = [json.loads(line) for line in f]
    finally:
        trainer.close()
    return {"config_hash": trainer.config_hash, "updates": updates,
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
    moved = 0
    for t, (g, w) in enumerate(zip(got["updates"], want["updates"])):
        assert g.keys() == w.keys()
        for k in w:
            for (dg, _), (dw, ww) in zip(g[k], w[k]):
                assert abs(dg - dw) <= 2**-22 * abs(ww) + 2**-19 * abs(dw), f"step {t} {k}: {dg} vs {dw}"
                moved += dw != 0.0
    assert moved > 0.9 * sum(len(v) for u in want["updates"] for v in u.values())  # the checks compare changes
