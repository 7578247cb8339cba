"""Experiment trackers beside ``metrics.jsonl`` (``run.loggers=[tensorboard,wandb,mlflow]``), rank 0 only.

Each tracker receives the scalars ``metrics.jsonl`` records: every number of a step record under ``train/<key>``
at its step, the held-out score under ``eval/score`` at its step. Each is an extra, checked at config time so a
missing package is one line before anything starts. Where a tracker's own settings are unset, it writes inside
run.dir and needs no network: wandb follows ``WANDB_MODE`` (else online, as wandb does; ``offline`` writes
run.dir/wandb), mlflow follows ``MLFLOW_TRACKING_URI`` (else a file store in run.dir/mlruns). A rerun of a
stopped run continues the same tracker run (its id is kept in run.dir).
"""
from __future__ import annotations

import importlib.util
import logging
import os
import time
import uuid

from esopt_mp.core.errors import StartupError
from esopt_mp.runfiles import run_subdir, write_atomic
from esopt_mp.typed import ConfigError, flatten

log = logging.getLogger(__name__)
# name -> (the module it imports, the extra that installs it)
TRACKERS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}


def check_loggers(names: list[str], key: str = "run.loggers") -> None:
    """Known, not repeated, installed: refused in one line naming the extra."""
    for n in names:
        if n not in TRACKERS:
            raise ConfigError(f"{key}: unknown tracker {n!r}; known: {', '.join(TRACKERS)}")
        if importlib.util.find_spec(TRACKERS[n][0]) is None:
            raise ConfigError(f"{key}: {n} is not installed: pip install -e '.[{TRACKERS[n][1]}]' "
                              f"(or drop it from run.loggers)")
    if len(set(names)) != len(names):
        raise ConfigError(f"{key}: a tracker is named twice: {names}")


def check_can_start(names: list[str], run_dir: str) -> str:
    """The dry run's view of the trackers: where each would write, and a wandb that would need a login it
    does not have (one line; mlflow's server is reached only when the run starts)."""
    out = []
    for n in names:
        if n == "wandb":
            mode = os.environ.get("WANDB_MODE", "online")
            if mode not in ("offline", "disabled", "dryrun") and not _wandb_logged_in():
                raise StartupError("run.loggers: wandb is online but has no API key: wandb login (or WANDB_API_KEY), "
                                   "or WANDB_MODE=offline to write run.dir/wandb")
            out.append(f"wandb ({mode})")
        elif n == "mlflow":
            out.append(f"mlflow ({os.environ.get('MLFLOW_TRACKING_URI') or 'file store in run.dir/mlruns'})")
        else:
            out.append(f"{n} (run.dir/tensorboard)")
    return "trackers: " + ", ".join(out)


def _wandb_logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    try:
        auth = netrc.netrc(os.environ.get("NETRC") or os.path.expanduser("~/.netrc"))
    except (OSError, netrc.NetrcParseError):
        return False
    return any(host.startswith("api.wandb.ai") or "wandb" in host for host in auth.hosts)


def scalars(record: dict) -> tuple[int, dict] | None:
    """``(step, {name: value})`` of a metrics record a tracker shows, or None (details, the summary)."""
    if "eval" in record and "eval_step" in record:
        return record["eval_step"], {"eval/score": float(record["eval"])}
    if "step" in record:
        vals = {f"train/{k}": float(v) for k, v in record.items()
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        return record["step"], vals
    return None


def _kept_id(run_dir: str, name: str, new) -> str:
    """The tracker run's id kept in run.dir (a resumed run logs into the same tracker run), else a new one."""
    path = os.path.join(run_dir, f".{name}_run_id")
    if os.path.isfile(path):
        with open(path) as f:
            return f.read().strip()
    rid = new()
    write_atomic(path, rid)  # a link there is replaced, not written through
    return rid


class TensorBoard:
    def __init__(self, run_dir: str, name: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.w = SummaryWriter(run_subdir(os.path.join(run_dir, "tensorboard")))

    def log(self, step: int, values: dict) -> None:
        for k, v in values.items():
            self.w.add_scalar(k, v, step)
        self.w.flush()

    def close(self) -> None:
        self.w.close()


class Wandb:
    def __init__(self, run_dir: str, name: str, config: dict):
        import wandb

        from esopt_mp.progress import interactive

        run_subdir(os.path.join(run_dir, "wandb"))  # where wandb.init(dir=run_dir) writes: not through a link
        rid = _kept_id(run_dir, "wandb", lambda: uuid.uuid4().hex[:12])
        quiet = not interactive()  # a batch log: none of wandb's coloured banner and teardown lines
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "esopt_mp"), name=name, id=rid,
                              resume="allow", dir=run_dir, config=config,
                              settings=wandb.Settings(silent=quiet, console="off" if quiet else "auto"))

    def log(self, step: int, values: dict) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflow:
    def __init__(self, run_dir: str, name: str, config: dict):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # a local file store (mlflow keeps it in maintenance mode, asks for an opt-in)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = "file:" + run_subdir(os.path.join(os.path.abspath(run_dir), "mlruns"))
        self.client = MlflowClient(tracking_uri=uri)
        exp_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "esopt_mp")
        exp = self.client.get_experiment_by_name(exp_name)
        eid = exp.experiment_id if exp else self.client.create_experiment(exp_name)
        fresh = []

        def new() -> str:
            fresh.append(True)
            return self.client.create_run(eid, run_name=name).info.run_id

        self.run_id = _kept_id(run_dir, "mlflow", new)
        if fresh:
            params = [Param(k, str(v)[:500]) for k, v in flatten(config).items()]
            for i in range(0, len(params), 100):  # mlflow's limit per batch
                self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, step: int, values: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


BUILDERS = {"tensorboard": TensorBoard, "wandb": Wandb, "mlflow": MLflow}


def build_trackers(names: list[str], run_dir: str, config: dict) -> list:
    """The trackers ``names`` of the run in ``run_dir`` (its name: the directory's), each given the config."""
    name = os.path.basename(os.path.abspath(run_dir))
    out = []
    for n in names:
        try:
            out.append(BUILDERS[n](run_dir, name, config))
        except Exception as e:  # noqa: BLE001 - no login, a server that does not answer: one line, not a traceback
            for t in out:
                t.close()
            raise StartupError(f"run.loggers: {n} could not start: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
                               f"{' (wandb login, or WANDB_MODE=offline)' if n == 'wandb' else ''}") from None
    if out:
        log.info("trackers: %s", ", ".join(names))
    return out
