"""The one place collectives run: static rule, byte accounting, stop flag, timeout config, health warnings."""
import ast
import logging
import math
import os

import pytest
import torch

from esopt_mp.config import ConfigError, build_config
from esopt_mp.ledger import DegenerateRunError, Health
from esopt_mp.parallel import Collectives, CommStats, ParallelDims

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
COLLECTIVE_NAMES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
                    "broadcast_object_list", "barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor",
                    "all_to_all", "all_to_all_single", "gather", "gather_object", "scatter", "scatter_object_list",
                    "send", "recv", "isend", "irecv", "monitored_barrier"}


def _distributed_calls(path):
    """(line, name) of every call of a torch.distributed collective in ``path``, however it was imported."""
    tree = ast.parse(open(path).read(), path)
    aliases, direct = {"torch.distributed", "torch.distributed.distributed_c10d"}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in ("torch.distributed", "torch.distributed.distributed_c10d"):
                    aliases.add(a.asname or a.name)
        elif isinstance(node, ast.ImportFrom) and node.module in ("torch.distributed",
                                                                  "torch.distributed.distributed_c10d"):
            for a in node.names:
                if a.name in COLLECTIVE_NAMES:
                    direct[a.asname or a.name] = a.name
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in COLLECTIVE_NAMES and ast.unparse(f.value) in aliases:
            out.append((node.lineno, f.attr))
        elif isinstance(f, ast.Name) and f.id in direct:
            out.append((node.lineno, direct[f.id]))
    return sorted(out)


def test_no_collective_outside_parallel():
    found, inside = [], []
    for base in ("esopt_mp", "tools", "launch"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, base)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    rel = os.path.relpath(path, ROOT)
                    calls = _distributed_calls(path)
                    (inside if rel.startswith(os.path.join("esopt_mp", "parallel")) else found).extend(
                        f"{rel}:{line} {fn}" for line, fn in calls)
    assert not found, f"torch.distributed collectives outside esopt_mp/parallel/: {found}"
    assert any("collectives.py" in c and "all_reduce" in c for c in inside)  # the scanner does see calls


def test_scanner_sees_every_import_style(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("import torch.distributed as dist\nfrom torch.distributed import barrier as b\n"
                 "import torch\ndist.all_reduce(x)\nb()\ntorch.distributed.broadcast(x, 0)\n")
    assert _distributed_calls(str(p)) == [(4, "all_reduce"), (5, "barrier"), (6, "broadcast")]


def test_local_collectives_are_identity_and_count_nothing():
    dims = ParallelDims(1, 1, 1)
    c = Collectives(dims)
    assert dims.comm_device == torch.device("cpu") and c.device == torch.device("cpu")
    t = torch.arange(6.0).view(2, 3)
    assert torch.equal(c.all_gather(t)[0], t) and c.all_gather(t).shape == (1, 2, 3)
    assert torch.equal(c.all_reduce(t, "max"), t)
    assert c.broadcast_object({"a": [1]}) == {"a": [1]} and c.any(True) and not c.any(False)
    c.barrier()
    assert c.stats.total == 0 and c.stats.calls == 0
    with pytest.raises(ValueError, match="all_reduce op"):
        c.all_reduce(t, "mean")
    assert dims.comm is dims.comm  # one object per process and dims


def test_comm_stats_difference():
    a = CommStats()
    a.add("all_gather", 10, 10)
    b = a.copy()
    b.add("broadcast", 5, 0)
    b.add("all_gather", 1, 1)
    d = b - a
    assert (d.sent, d.received, d.calls, d.total) == (6, 1, 2, 7)
    assert d.by_op == {"broadcast": [1, 5], "all_gather": [1, 2]}


def test_timeout_and_health_config_validated():
    cfg = build_config({"parallel": {"timeout_s": 60}, "run": {"degenerate_steps": 2, "stop_on_degenerate": True}})
    assert cfg.parallel.timeout_s == 60.0 and build_config({}).parallel.timeout_s == 1800.0
    for bad in (0, -5, float("inf")):
        with pytest.raises(ConfigError, match="parallel.timeout_s"):
            build_config({"parallel": {"timeout_s": bad}})
    with pytest.raises(ConfigError, match="run.degenerate_steps"):
        build_config({"run": {"degenerate_steps": 0}})


def test_init_distributed_rejects_bad_timeout_and_nccl_without_cuda():
    from esopt_mp.parallel import LaunchEnv, init_distributed

    le = LaunchEnv(0, 1, 0, "127.0.0.1", 29500, "python")
    with pytest.raises(ValueError, match="parallel.timeout_s"):
        init_distributed(le, 1, 1, timeout_s=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="parallel.backend=nccl needs CUDA"):
            init_distributed(le, 1, 1, backend="nccl")


def test_health_equal_returns_warn_after_k_steps_then_stop(caplog):
    h = Health(degenerate_steps=2, stop=True)
    with caplog.at_level(logging.ERROR, logger="esopt_mp.ledger"):
        assert h.check(0, [0.5, 0.5, 0.5, 0.5], [0, 0, 0, 0]) == "all 4 finite returns are equal (0.5): the update is a no-op"
        assert not caplog.records  # one flat step is not yet a pattern
        assert h.check(1, [1.0, 2.0], [-1.0, 1.0]) is None  # learning resets the streak
        h.check(2, [0.5, 0.5], [0, 0])
        with pytest.raises(DegenerateRunError, match="2 consecutive steps learned nothing.*equal"):
            h.check(3, [0.5, math.nan], [0, 0])
    assert "step 3 learned nothing (2 step(s) in a row)" in caplog.text


def test_health_all_nan_warns_at_once_with_errors(caplog):
    h = Health(degenerate_steps=3, stop=False)
    h.note_error("member 0: PermissionError: /usr/bin/python3")
    with caplog.at_level(logging.ERROR, logger="esopt_mp.ledger"):
        r = h.check(0, [math.nan, math.nan], [0, 0], ["episode 4: reset: boom"])
    assert r.startswith("all 2 returns are NaN: every episode failed; sample errors: member 0: PermissionError")
    assert "episode 4: reset: boom" in caplog.text and "!!!" in caplog.text
    for t in range(1, 5):  # never raises when stop_on_degenerate is off
        h.check(t, [math.nan], [0])
    assert h.streak == 5
