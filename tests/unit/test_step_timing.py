"""ESTrainer.step records ES's own time (perturb, restore, update) beside the rollouts: tools/bench.py reads it."""
import time

from esopt_mp.config import build_config
from esopt_mp.parallel import LaunchEnv, init_distributed


def test_step_records_perturb_restore_update_seconds(tmp_path):
    from esopt_mp.trainer import ESTrainer

    cfg = build_config({"run": {"dir": str(tmp_path)}, "model": {"tiny": {"hidden_size": 32, "num_hidden_layers": 2}},
                        "objective": {"name": "target_logprob", "batch": 2}, "es": {"population": 4, "steps": 1}}, 1)
    trainer = ESTrainer(cfg, init_distributed(LaunchEnv(0, 1, 0, "127.0.0.1", 0, "python"), 1, 1))
    calls = {"perturb": 0, "restore": 0, "update": 0}
    delay = {"perturb": 0.02, "restore": 0.03, "update": 0.05}

    def slowed(name, fn):
        def wrapped(*a, **kw):
            calls[name] += 1
            time.sleep(delay[name])
            return fn(*a, **kw)
        return wrapped

    for name in calls:
        setattr(trainer.perturber, name, slowed(name, getattr(trainer.perturber, name)))
    try:
        rec = trainer.step(0)
    finally:
        trainer.close()
    assert calls == {"perturb": 4, "restore": 4, "update": 1}
    # sums over the step's members, each at least the time its op was held up
    assert rec["perturb_s"] >= 4 * delay["perturb"] and rec["restore_s"] >= 4 * delay["restore"]
    assert rec["update_s"] >= delay["update"]
    assert rec["perturb_s"] + rec["restore_s"] <= rec["rollout_s"]  # both happen inside the rollout phase
    assert rec["rollout_s"] + rec["update_s"] <= rec["step_s"]  # the update comes after it
