"""Each heuristic-design problem evaluates its reference heuristic, in the sandbox, on its shipped instances,
to the fitness an independent plain-Python computation here gives (first instances of the train split)."""
import itertools
import math
import random

import numpy as np
import pytest

from esopt_mp.envs import ahd, make
from esopt_mp.envs.ahd.common import dist_matrix
from esopt_mp.envs.sandbox import Sandbox, SandboxLimits


@pytest.fixture(scope="module")
def sb():
    return Sandbox(SandboxLimits(wall_s=120, cpu_s=120, output_bytes=32 << 20))


def evaluate(sb, name, k, code=None, seed=0):
    p = ahd.get(name)
    inst = p.instances("train")[:k]
    r = p.evaluate(code or p.reference(), inst, sb, seed=seed)
    assert r.error is None, r.error
    return p, inst, r


def tour_len(pts, tour):
    return sum(math.hypot(*(pts[tour[i]] - pts[tour[i - 1]])) for i in range(len(tour)))


def test_registry_and_splits():
    assert ahd.known() == ["asp_constructive", "bpp_offline_aco", "bpp_online", "cvrp_aco", "kp_constructive",
                           "tsp_aco", "tsp_constructive"]
    with pytest.raises(ValueError, match=r"env.heuristic.problem: unknown .*'tsp'.*known: \['asp_constructive'"):
        ahd.get("tsp")
    with pytest.raises(ValueError, match="env.heuristic.problem"):
        make("heuristic", problem="vrp")
    assert ahd.get("tsp_aco").splits() == {"test": [20, 50, 100], "train": [50], "val": [20, 50, 100]}
    assert ahd.get("bpp_offline_aco").splits() == {"test": [500, 1000], "train": [500], "val": [120, 500, 1000]}
    assert len(ahd.get("cvrp_aco").instances("val", 20)) == 64
    tasks = ahd.generate_tasks("kp_constructive", 3, seed=0, split="val")
    assert [t["indices"][0] for t in tasks] == [0, 8, 16] and len({t["seed"] for t in tasks}) == 3


FARTHEST_OFFERED = ("def select_next_node(current_node, destination_node, unvisited_nodes, distance_matrix):\n"
                    "    return unvisited_nodes[-1]\n")


def offered(pts, tour):
    """The candidates the paper's evaluator offers after ``tour``: the current node's neighbours by distance,
    the visited ones removed, at most 50."""
    cur = tour[-1]
    order = sorted((j for j in range(len(pts)) if j != cur), key=lambda j: math.hypot(*(pts[j] - pts[cur])))
    return [j for j in order if j not in tour][:50]


def test_tsp_constructive_seed_function_is_nearest_neighbour(sb):
    # the evaluator hands an int64 array of at most 50 nearest unvisited neighbours in distance order (the
    # paper's evaluators): the settings' seed function (equal scores, min takes the first) is nearest neighbour,
    # recomputed here in plain Python, and the last node is the one left over
    p, inst, r = evaluate(sb, "tsp_constructive", 3)
    for pts, tour in zip(inst, r.details["tours"]):
        nn = [0]
        while len(nn) < len(pts) - 1:
            nn.append(offered(pts, nn)[0])
        nn += [j for j in range(len(pts)) if j not in nn]
        assert tour == nn
    ref = np.mean([tour_len(pts, t) for pts, t in zip(inst, r.details["tours"])])
    assert r.objective == pytest.approx(ref, rel=1e-12) and r.score == -r.objective
    assert r.objective == pytest.approx(7.1156, abs=1e-4)  # measured: NN on train50[0:3]


def test_tsp_constructive_offers_at_most_50_candidates_in_distance_order(sb):
    # on 100 nodes the cap matters: always taking the last offered candidate follows the 50th nearest unvisited
    # node while more than 50 are left, recomputed here; a visited node is a failure
    p = ahd.get("tsp_constructive")
    inst = p.instances("val", 100)[:2]
    r = p.evaluate(FARTHEST_OFFERED, inst, sb)
    assert r.error is None, r.error
    for pts, tour in zip(inst, r.details["tours"]):
        want = [0]
        while len(want) < len(pts) - 1:
            want.append(offered(pts, want)[-1])
        want += [j for j in range(len(pts)) if j not in want]
        assert tour == want
    assert r.objective == pytest.approx(np.mean([tour_len(q, t) for q, t in zip(inst, r.details["tours"])]))
    bad = FARTHEST_OFFERED.replace("unvisited_nodes[-1]", "0")
    assert "visited or not a node" in p.evaluate(bad, inst, sb).error
    typed = FARTHEST_OFFERED.replace("    return", "    assert unvisited_nodes.dtype == np.int64\n"
                                     "    assert 1 <= len(unvisited_nodes) <= 50\n    return")
    assert p.evaluate(typed, inst, sb).error is None


def pack(x, cap, choose):
    """The paper's knapsack protocol in plain Python: ``choose(cap, weights, values)`` over the remaining items
    (original order) gives an index or None; stop when nothing fits, on None, or when the choice does not fit."""
    left, total = list(range(len(x))), 0.0
    while left and any(x[i][0] <= cap for i in left):
        k = choose(cap, [x[i][0] for i in left], [x[i][1] for i in left])
        if k is None or x[left[k]][0] > cap:
            break
        cap, total = cap - x[left[k]][0], total + x[left[k]][1]
        del left[k]
    return total


def test_kp_greedy_ratio(sb):
    # reference: greedy value/weight among the items that fit (the settings' seed function always answers 0:
    # by its own comment useless), recomputed here item by item; capacity 25 for 100 items
    p, inst, r = evaluate(sb, "kp_constructive", 64)
    for x, got in zip(inst, r.details["values"]):
        want = pack(x, 25.0, lambda c, w, v: max((i for i in range(len(w)) if w[i] <= c), key=lambda i: v[i] / w[i]))
        assert got == pytest.approx(want, rel=1e-12)
    assert r.score == r.objective == pytest.approx(np.mean(r.details["values"]))
    assert r.objective == pytest.approx(40.1460, abs=1e-4)  # measured: greedy ratio on all 64 of train100


def test_kp_none_stops_and_a_choice_that_does_not_fit_stops(sb):
    # the function gets the remaining items' weights and values and answers an index into them or None
    p = ahd.get("kp_constructive")
    inst = p.instances("train")[:4]
    heaviest = "def select_next_item(remaining_capacity, weights, values):\n    return int(np.argmax(weights))\n"
    r = p.evaluate(heaviest, inst, sb)
    assert r.error is None, r.error
    for x, got in zip(inst, r.details["values"]):
        assert got == pytest.approx(pack(x, 25.0, lambda c, w, v: max(range(len(w)), key=lambda i: w[i])), rel=1e-12)
    three = ("def select_next_item(remaining_capacity, weights, values):\n"
             "    return None if len(weights) <= 97 else int(np.argmax(values))\n")
    r = p.evaluate(three, inst, sb)
    assert r.error is None and [len(k) for k in r.details["picked"]] == [3] * 4
    for x, got in zip(inst, r.details["picked"]):
        assert got == sorted(range(100), key=lambda i: -x[i][1])[:3]
    out = "def select_next_item(remaining_capacity, weights, values):\n    return len(weights)\n"
    assert "expected an index below 100" in p.evaluate(out, inst, sb).error


def admissible(vectors, n, w, triples):
    for v in vectors:
        assert len(v) == n and sum(x != 0 for x in v) == w and set(v) <= {0, 1, 2}
    assert len(set(vectors)) == len(vectors)
    good = {(0, 1, 2), (0, 0, 1), (0, 0, 2)}
    for a, b, c in triples:
        assert any(tuple(sorted(t)) in good for t in zip(vectors[a], vectors[b], vectors[c])), (a, b, c)


def test_asp_seed_function_builds_an_admissible_set(sb):
    # reference: the settings' seed function (priority 1 for every vector: candidates taken in order);
    # the set is checked against the definition of an admissible set (every triple on I(9, 6); 20000 random
    # triples on the paper's I(15, 10))
    p = ahd.get("asp_constructive")
    small = p.evaluate(p.reference(), [(9, 6)], sb)
    assert small.error is None
    vs = small.details["set"]
    admissible(vs, 9, 6, itertools.combinations(range(len(vs)), 3))
    r = p.evaluate(p.reference(), p.instances("train"), sb)
    vs = r.details["set"]
    rng = random.Random(0)
    admissible(vs, 15, 10, (rng.sample(range(len(vs)), 3) for _ in range(20000)))
    assert r.objective == len(vs) == 1842 and r.score == 1842  # measured: I(15, 10) with the seed function


def test_tsp_aco_inverse_distance(sb):
    # reference: the settings' seed function 1/d; the best tour is a permutation whose length, recomputed
    # here, is the objective; the same seed gives the same figure
    p, inst, r = evaluate(sb, "tsp_aco", 2)
    for pts, tour, length in zip(inst, r.details["tours"], r.details["lengths"]):
        assert sorted(tour) == list(range(len(pts))) and tour_len(pts, tour) == pytest.approx(length, rel=1e-9)
    assert r.objective == pytest.approx(np.mean(r.details["lengths"])) and r.score == -r.objective
    assert evaluate(sb, "tsp_aco", 2)[2].objective == r.objective
    assert r.objective == pytest.approx(6.4093, abs=1e-4)  # measured: seed 0, train50[0:2]


def test_cvrp_aco_inverse_distance(sb):
    # reference: the settings' seed function 1/d; every customer once, every trip within capacity 50,
    # the cost recomputed here from the route
    p, inst, r = evaluate(sb, "cvrp_aco", 2)
    for x, route, cost in zip(inst, r.details["routes"], r.details["costs"]):
        assert route[0] == route[-1] == 0 and sorted(v for v in route if v) == list(range(1, len(x)))
        load = 0.0
        for v in route[1:]:
            load = 0.0 if v == 0 else load + x[v, 0]
            assert load <= 50
        d = dist_matrix(x[:, 1:])
        assert sum(d[a, b] for a, b in zip(route, route[1:])) == pytest.approx(cost, rel=1e-9)
    assert r.objective == pytest.approx(np.mean(r.details["costs"])) and r.score == -r.objective
    assert r.objective == pytest.approx(13.1571, abs=1e-4)  # measured: seed 0, train50[0:2]


def test_bpp_offline_aco_seed_function(sb):
    # reference: the settings' seed function (rows of demand / max demand), "sample" mode; every bin within
    # capacity 150, the bins counted and the gap to ceil(sum / 150) recomputed here
    p, inst, r = evaluate(sb, "bpp_offline_aco", 1)
    for dem, bins, used, gap in zip(inst, r.details["packings"], r.details["bins_used"], r.details["gaps"]):
        load = {}
        for item, b in enumerate(bins):
            load[b] = load.get(b, 0) + int(dem[item])
        assert sorted(load) == list(range(len(load))) == list(range(used)) and max(load.values()) <= 150
        lb = -(-sum(int(v) for v in dem) // 150)
        assert gap == pytest.approx((len(load) - lb) / lb)
    assert r.details["mode"] == "sample" and r.objective == np.mean(r.details["bins_used"])
    assert r.objective == 200 and r.score == -r.objective  # measured: seed 0, train500[0]
    env = make("heuristic", max_turns=1, sandbox=sb, problem="bpp_offline_aco")  # the episode info names the bins
    env.reset({"problem": "bpp_offline_aco", "split": "train", "indices": [0], "seed": 0})
    _, ret, _, _, info = env.step(f"```python\n{p.reference()}```")
    assert info["bins"] == 200 == -ret and info["packings"] == r.details["packings"]


def test_env_plays_a_problem_by_config(sb):
    env = make("heuristic", max_turns=1, sandbox=sb, problem="tsp_constructive")
    task = ahd.generate_tasks("tsp_constructive", 1, split="train")[0]
    msgs, _ = env.reset(task)
    assert "select_next_node" in msgs[0]["content"] and "select_next_node_v1" in msgs[1]["content"]
    ref = ahd.get("tsp_constructive").reference()
    _, ret, done, _, info = env.step(f"```python\n{ref}```")
    assert done and info["error"] is None and ret == -info["length"] == info["best_score"]
    with pytest.raises(ValueError, match="env.heuristic.problem='tsp_constructive'"):
        env.reset(ahd.generate_tasks("kp_constructive", 1)[0])


@pytest.mark.parametrize("problem", ["asp_constructive", "tsp_aco"])
def test_the_problems_own_limits_carry_a_full_answer(problem):
    """The env's sandbox (the problem's default limits) fits the largest replies: 2432 priorities, a 50 x 50 matrix."""
    env = make("heuristic", max_turns=1, problem=problem)
    env.reset(ahd.generate_tasks(problem, 1)[0])
    _, ret, _, _, info = env.step(f"```python\n{ahd.get(problem).reference()}```")
    prob = ahd.get(problem)
    assert info["error"] is None and ret == info["score"] > prob.to_score(prob.fail_objective(env.instances))


@pytest.mark.parametrize("problem,sig", [("tsp_aco", "distance_matrix"),
                                         ("cvrp_aco", "distance_matrix, coordinates, demands, capacity")])
def test_aco_huge_heuristic_still_builds_valid_solutions(sb, problem, sig):
    # an all-1e308 matrix overflowed pheromone x heuristic to inf -> NaN and the sampler revisited nodes (a
    # 12-node "tour" of 20 scored 9.25); bounded now, every solution is a tour / a feasible route
    p = ahd.get(problem)
    inst = p.instances("val", 20)[:1]
    code = f"import numpy as np\ndef heuristics({sig}):\n    return np.full(distance_matrix.shape, 1e308)\n"
    r = p.evaluate(code, inst, sb, seed=0)
    assert r.error is None and np.isfinite(r.objective)
    if problem == "tsp_aco":
        tour = r.details["tours"][0]
        assert sorted(tour) == list(range(20)) and tour_len(inst[0], tour) == pytest.approx(r.objective, rel=1e-9)
    else:
        route, dem = r.details["routes"][0], inst[0][:, 0]
        assert sorted(v for v in route if v) == list(range(1, 21))
        load = 0.0
        for v in route:
            load = 0.0 if v == 0 else load + dem[v]
            assert load <= 50


def test_aco_solution_checks_reject_non_solutions():
    from esopt_mp.envs.ahd import aco
    from esopt_mp.envs.ahd.common import Failure
    aco.check_tours(np.array([[2, 0, 1], [0, 1, 2]]))
    with pytest.raises(Failure, match="not a permutation"):
        aco.check_tours(np.array([[0, 1, 1]]))
    dem = np.array([0.0, 30.0, 30.0])
    aco.check_routes(np.array([[0, 1, 0, 2, 0]]), dem, 50)
    with pytest.raises(Failure, match="over capacity"):
        aco.check_routes(np.array([[0, 1, 2, 0, 0]]), dem, 50)
    with pytest.raises(Failure, match="exactly once"):
        aco.check_routes(np.array([[0, 1, 0, 1, 0]]), dem, 50)
