"""Broken candidate code fails with a clear reason, and no candidate escapes the sandbox, on every problem."""
import os
import socket

import pytest

from esopt_mp.envs import ahd
from esopt_mp.envs.sandbox import Sandbox, SandboxLimits

PROBLEMS = [p for p in ahd.known() if p != "bpp_online"]  # online bin packing: tests/integration/test_heuristic_reward.py
FUNC = {p: ahd.get(p).func_name for p in PROBLEMS}
# a valid answer whatever the arguments: the first offered node / item, one priority, a matrix of ones
VALID = {
    "tsp_constructive": "    return min(a[2])\n",  # unvisited_nodes is a set, as the signature says
    "kp_constructive": "    return int(np.argmin(a[1]))\n",
    "asp_constructive": "    return 1.0\n",
    "tsp_aco": "    return np.ones(a[0].shape)\n",
    "cvrp_aco": "    return np.ones(a[0].shape)\n",
    "bpp_offline_aco": "    return np.ones((len(a[0]), len(a[0])))\n",
}
BROKEN = {  # what the code does -> the reason contains one of these
    "syntax": ("def {f}(*a)\n    return 1\n", ("SyntaxError",)),
    "exception": ("def {f}(*a):\n    raise ValueError('boom')\n", ("ValueError: boom",)),
    "infinite loop": ("def {f}(*a):\n    while True:\n        pass\n", ("timeout", "cpu limit")),
    "wrong shape": ("def {f}(*a):\n    return np.zeros(3)\n", ("expected",)),
    "non-finite": ("def {f}(*a):\n    return np.full(np.shape(a[0]) or 1, np.nan)\n", ("non-finite",)),
    "no function": ("def something_else(*a):\n    return 1\n", ("no `def {f}(...)` found",)),
}


@pytest.fixture(scope="module")
def sb():
    return Sandbox(SandboxLimits(wall_s=8, cpu_s=3, memory_mb=512, nproc=16, output_bytes=8 << 20))


def few(p):
    """One small shipped instance (offline bin packing: the first 40 items of one), so each test takes seconds."""
    prob = ahd.get(p)
    return prob.instances("val", 20)[:1] if p in ("tsp_aco", "cvrp_aco") else (
        [prob.instances("val", 120)[0][:40]] if p == "bpp_offline_aco" else prob.instances("train")[:1])


ACO = ("tsp_aco", "cvrp_aco", "bpp_offline_aco")  # NaN / inf in their matrices are cleaned (the paper's evaluators)


@pytest.mark.parametrize("problem,kind", [(p, k) for p in PROBLEMS for k in sorted(BROKEN)
                                          if not (k == "non-finite" and p in ACO)])
def test_broken_code_fails_with_its_reason(sb, problem, kind):
    prob = ahd.get(problem)
    code, reasons = BROKEN[kind][0].format(f=FUNC[problem]), [w.format(f=FUNC[problem]) for w in BROKEN[kind][1]]
    r = prob.evaluate(code, few(problem), sb)
    fail = prob.fail_objective(few(problem))
    assert r.error and any(w in r.error for w in reasons), r.error
    assert r.objective == fail and r.score == prob.to_score(fail)


@pytest.mark.parametrize("problem", PROBLEMS)
def test_failure_scores_below_any_valid_answer(sb, problem):
    prob = ahd.get(problem)
    ok = prob.evaluate(f"def {FUNC[problem]}(*a):\n" + VALID[problem], few(problem), sb)
    assert ok.error is None and ok.score > prob.to_score(prob.fail_objective(few(problem)))


@pytest.mark.parametrize("problem", ACO)
def test_aco_matrices_are_cleaned_as_the_paper_does(sb, problem):
    # NaN -> 1e-9, +inf -> 1e9, -inf -> 1e-9, below 1e-9 -> 1e-9: each scores exactly what its cleaned matrix does
    prob, inst = ahd.get(problem), few(problem)
    f = FUNC[problem]

    def run(body):
        r = prob.evaluate(f"def {f}(*a):\n    n = len(a[0])\n    m = np.ones((n, n))\n{body}    return m\n", inst, sb)
        assert r.error is None, r.error
        return r

    nan = run("    m[0, 1:] = np.nan\n    m[1, 2:] = -np.inf\n    m[2, 3:] = -5.0\n    m[3, 4:] = np.inf\n")
    cleaned = run("    m[0, 1:] = 1e-9\n    m[1, 2:] = 1e-9\n    m[2, 3:] = 1e-9\n    m[3, 4:] = 1e9\n")
    ones = run("")
    assert nan.objective == cleaned.objective and nan.details == cleaned.details
    if problem != "bpp_offline_aco":  # the colony's choices differ from the all-ones matrix's (bins may not)
        assert nan.details != ones.details


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """A secret file and a listening TCP port on the host: neither may be reachable from the candidate."""
    d = tmp_path_factory.mktemp("host")
    (d / "secret").write_text("s3cret")
    os.chmod(d, 0o777)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    yield d, srv.getsockname()[1]
    srv.close()


ESCAPE = """
import os, socket
LEAK = []
try:
    LEAK.append(open({secret!r}).read())
except OSError:
    pass
try:
    open({drop!r}, "w").write("x")
    LEAK.append("wrote")
except OSError:
    pass
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=1)
    LEAK.append("tcp")
except OSError:
    pass
def {f}(*a):
    if LEAK:
        raise RuntimeError("escaped: " + repr(LEAK))
{body}"""


@pytest.mark.parametrize("problem", PROBLEMS)
def test_files_and_network_outside_stay_out_of_reach(sb, host, problem):
    d, port = host
    code = ESCAPE.format(secret=str(d / "secret"), drop=str(d / "dropped"), port=port, f=FUNC[problem],
                         body=VALID[problem])
    r = ahd.get(problem).evaluate(code, few(problem), sb)
    assert r.error is None, r.error  # it ran, and saw neither the file nor the port
    assert not (d / "dropped").exists()


@pytest.mark.parametrize("problem", PROBLEMS)
def test_fork_bomb_is_contained(sb, problem):
    bomb = "import os\nwhile True:\n    os.fork()\n" + f"def {FUNC[problem]}(*a):\n" + VALID[problem]
    r = ahd.get(problem).evaluate(bomb, few(problem), sb)
    limits = ("Resource temporarily unavailable", "BlockingIOError", "timeout")
    assert r.error and any(w in r.error for w in limits), r.error
    ok = ahd.get(problem).evaluate(f"def {FUNC[problem]}(*a):\n" + VALID[problem], few(problem), sb)
    assert ok.error is None, ok.error  # and the sandbox still works
