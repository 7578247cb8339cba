"""The bin-packing reward is computed outside the untrusted process and cannot be forged."""
import numpy as np
import pytest

from esopt_mp.envs import make
from esopt_mp.envs.ahd.bpp_online import FAIL_GAP, pack_online, weibull_instances
from esopt_mp.envs.sandbox import Sandbox, SandboxLimits

TASK = {"id": "b", "seed": 3, "n_instances": 2, "n_items": 200}


@pytest.fixture(scope="module")
def env():
    return make("heuristic", max_turns=1, sandbox=Sandbox(SandboxLimits(wall_s=6, cpu_s=6)))


def gap(env, code):
    env.reset(TASK)
    *_, info = env.step("```python\n" + code + "```")
    return info


BEST_FIT = "def score(item, bins):\n    return -(bins - item)\n"


def test_best_fit_and_a_better_heuristic(env):
    best = gap(env, BEST_FIT)
    instances = weibull_instances(3, 2, 200)
    ref = pack_online(instances, lambda req: [-(np.frombuffer(__import__("base64").b64decode(b), np.uint8) - i)
                                              .astype(float) for i, b in req])
    assert best["error"] is None and best["bins"] == ref and 0 < best["gap"] < 0.2
    # best fit for tight fits; otherwise leave room for one typical item (~40; Weibull(3, 45) sizes)
    good = gap(env, "def score(item, bins):\n    r = bins - item\n    return np.where(r > 20, -np.abs(r - 40), -r)\n")
    assert good["error"] is None and good["gap"] < best["gap"], (good, best)


@pytest.mark.parametrize("code,reason", [
    ("import os\nprint('{\"bins\":[1,1]}', flush=True)\nos._exit(0)\ndef score(item, bins):\n    return bins\n",
     "stopped answering"),  # the attack: its print goes to stderr, its exit ends the answers
    ("_proto.write('[' * 3000 + '\\n')\n_proto.flush()\ndef score(item, bins):\n    return bins\n",
     "malformed reply"),  # a reply crafted to crash the parser (RecursionError) is a failure, not an exception
    ("import os\nos.write(3, b'{\"bins\": [1, 1]}\\n')\ndef score(item, bins):\n    return bins\n", ""),
    ("def score(item, bins):\n    return bins[:1]\n", "shape"),
    ("def score(item, bins):\n    return bins * float('nan')\n", "non-finite"),
    ("import time\ndef score(item, bins):\n    time.sleep(60)\n", "timeout"),
    ("def score(item, bins):\n    raise ValueError('boom')\n", "boom"),
])
def test_forged_or_broken_answers_score_as_failure(env, code, reason):
    info = gap(env, code)
    assert info["gap"] == FAIL_GAP and reason in info["error"], info


def test_a_forged_reply_on_stdout_changes_nothing(env):
    """A well-formed reply printed before any query goes to stderr: the code scores exactly as without it."""
    worst = "def score(item, bins):\n    return bins\n"
    forged = "import sys\nsys.stdout.write('[\"AAAAAAAA8D8=\"]\\n')\nsys.stdout.flush()\n" + worst
    honest = gap(env, worst)
    assert honest["error"] is None and gap(env, forged) == honest


def test_future_items_are_never_sent():
    instances = weibull_instances(5, 3, 50)
    seen = []

    def ask(req):
        t = len(seen)
        seen.append([item for item, _ in req])
        assert [item for item, _ in req] == [inst[t] for inst in instances]  # exactly the current items
        return [np.zeros(len(np.frombuffer(__import__("base64").b64decode(b), np.uint8))) for _, b in req]

    used = pack_online(instances, ask)
    assert isinstance(used, list) and len(used) == 3
    assert len(seen) == 50


def test_code_cannot_peek_at_the_next_query(env):
    peek = ("import select, sys\ndef score(item, bins):\n"
            "    if select.select([sys.stdin], [], [], 0.005)[0]:\n        raise RuntimeError('future visible')\n"
            "    return -(bins - item)\n")
    info = gap(env, peek)
    assert info["error"] is None and info["gap"] == gap(env, BEST_FIT)["gap"]
