import os

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under `-n N` each test process shares the cores with N - 1 others, and so does every run it launches: a trainer
# taking one thread per core (launch/train.py's default), beside another worker's, oversubscribes them, and
# OpenMP's spin-waiting makes each small op many times slower (a 2-step tiny run: 2.4 s on one thread, 22.6 s on
# two, beside a busy worker). The runs and tools a test starts inherit this share; a test may still set its own.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
if _WORKERS > 1:
    _SHARE = str(max(1, (os.cpu_count() or 1) // (2 * _WORKERS)))  # most launched worlds have two ranks
    os.environ.setdefault("ESOPT_THREADS", _SHARE)
    os.environ.setdefault("OMP_NUM_THREADS", _SHARE)


# What a test needs is said by its folder: ``-m "not slow"`` runs the in-process suite, ``-m distributed`` the
# spawned worlds, ``-m "not browser and not vllm"`` leaves out the stacks that need their own environment.
FOLDER_MARKERS = {
    "unit": ("unit",),
    "integration": ("process", "slow"),
    "distributed": ("distributed", "process", "slow"),
    "gpu": ("gpu",),
    "vllm": ("vllm", "process", "slow"),
    "web": ("browser", "process", "slow"),
}
_TESTS = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    for item in items:
        rel = os.path.relpath(str(item.path), _TESTS).split(os.sep)
        for name in FOLDER_MARKERS.get(rel[0], ()) if len(rel) > 1 else ():
            item.add_marker(name)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_PATCHED = (("esopt_mp.agent.skill_hooks", ("generate_texts", "skill_hooks")), ("esopt_mp.agent.loop", ("_encode",)),
            ("esopt_mp.agent.episodes.EpisodePlayer", ("make_env",)))


@pytest.fixture(autouse=True)
def _module_patches_are_undone():
    """Multi-process tests run their one-process reference in pytest's own process and patch module attributes
    there; one left patched changed a later test's environment (GRPO learned on a stub env and failed). A test
    that leaves one of these patched fails here, naming it."""
    import importlib

    def snapshot():
        out = {}
        for path, names in _PATCHED:
            mod, _, cls = path.rpartition(".") if path.endswith("EpisodePlayer") else (path, "", "")
            obj = getattr(importlib.import_module(mod), cls) if cls else importlib.import_module(mod)
            out.update({f"{path}.{n}": obj.__dict__.get(n) for n in names})
        return out

    before = snapshot()
    yield
    changed = [k for k, v in snapshot().items() if v is not before[k]]
    assert not changed, f"the test left {changed} patched: restore them (try/finally or monkeypatch)"
