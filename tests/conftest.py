import os

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_PATCHED = (("esopt_mp.prompt.hooks", ("generate_texts", "skill_hooks")), ("esopt_mp.agent.loop", ("_encode",)),
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
