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
    with pytest.raises(ValueError, match=r"env.problem: unknown .*'tsp'.*known: \['asp_constructive'"):
        ahd.get("tsp")
    with pytest.raises(ValueError, match="env.problem"):
        make("heuristic", problem="vrp")
    assert ahd.get("tsp_aco").splits() == {"test": [20, 50, 100], "train": [50], "val": [20, 50, 100]}
    assert ahd.get("bpp_offline_aco").splits() == {"test": [500, 1000], "train": [500], "val": [120, 500, 1000]}
    assert len(ahd.get("cvrp_aco").instances("val", 20)) == 64
    tasks = ahd.generate_tasks("kp_constructive", 3, seed=0, split="val")
    assert [t["indices"][0] for t in tasks] == [0, 8, 16] and len({t["seed"] for t in tasks}) == 3


NN_CODE = ("def select_next_node(current_node, destination_node, unvisited_nodes, distance_matrix):\n"
           "    rest = unvisited_nodes - {current_node}\n"  # set operations: the signature says `set`
           "    return min(rest, key=lambda n: distance_matrix[current_node][n])\n")


def test_tsp_constructive_seed_function_and_nearest_neighbour(sb):
    # the evaluator passes exactly the signature's types (ReEvo / MCTS-AHD eval.py): unvisited_nodes is a set of
    # ints. reference 1: the settings' seed_func (equal scores, min takes the set's first = smallest index) visits
    # the nodes in index order; reference 2: nearest neighbour written to the signature, recomputed here
    p, inst, r = evaluate(sb, "tsp_constructive", 3)
    assert r.details["tours"] == [list(range(len(pts))) for pts in inst]
    ident = np.mean([tour_len(pts, list(range(len(pts)))) for pts in inst])
    assert r.objective == pytest.approx(ident, rel=1e-12) and r.score == -r.objective
    assert r.objective == pytest.approx(26.6465, abs=1e-4)  # measured: index order on train50[0:3]
    _, _, r = evaluate(sb, "tsp_constructive", 3, code=NN_CODE)
    for pts, tour in zip(inst, r.details["tours"]):
        nn, left = [0], set(range(1, len(pts)))
        while left:
            nxt = min(left, key=lambda j: math.hypot(*(pts[j] - pts[nn[-1]])))
            nn.append(nxt)
            left.remove(nxt)
        assert tour == nn
    ref = np.mean([tour_len(pts, t) for pts, t in zip(inst, r.details["tours"])])
    assert r.objective == pytest.approx(ref, rel=1e-12)
    assert r.objective == pytest.approx(7.1156, abs=1e-4)  # measured: NN on train50[0:3]
    bad = NN_CODE.replace("unvisited_nodes - {current_node}", "set(range(len(distance_matrix)))")
    assert "visited or not a node" in p.evaluate(bad, inst, sb).error


def test_kp_greedy_ratio(sb):
    # reference: greedy value/weight (the settings' seed function always answers 0: by its own comment useless),
    # recomputed here item by item; capacity 25 for 100 items and capacity tolerance 1e-3 (the paper's evaluator)
    p, inst, r = evaluate(sb, "kp_constructive", 64)
    for x, got in zip(inst, r.details["values"]):
        cap, left, total = 25.0, list(range(len(x))), 0.0
        while any(x[i][0] < cap + 1e-3 for i in left):
            best = max((i for i in left if x[i][0] <= cap + 1e-3), key=lambda i: x[i][1] / x[i][0])
            cap, total = cap - x[best][0], total + x[best][1]
            left.remove(best)
        assert got == pytest.approx(total, rel=1e-12)
    assert r.score == r.objective == pytest.approx(np.mean(r.details["values"]))
    assert r.objective == pytest.approx(40.1484, abs=1e-4)  # measured: greedy ratio on all 64 of train100


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
    # reference: the settings' seed function (rows of demand / max demand); every bin within capacity 150,
    # the gap to ceil(sum / 150) recomputed here
    p, inst, r = evaluate(sb, "bpp_offline_aco", 1)
    for dem, bins, gap in zip(inst, r.details["bins"], r.details["gaps"]):
        load = {}
        for item, b in enumerate(bins):
            load[b] = load.get(b, 0) + int(dem[item])
        assert sorted(load) == list(range(len(load))) and max(load.values()) <= 150
        lb = -(-sum(int(v) for v in dem) // 150)
        assert gap == pytest.approx((len(load) - lb) / lb)
    assert r.objective == pytest.approx(0.0812, abs=1e-4) and r.score == -r.objective  # measured: seed 0


def test_env_plays_a_problem_by_config(sb):
    env = make("heuristic", max_turns=1, sandbox=sb, problem="tsp_constructive")
    task = ahd.generate_tasks("tsp_constructive", 1, split="train")[0]
    msgs, _ = env.reset(task)
    assert "select_next_node" in msgs[0]["content"] and "select_next_node_v1" in msgs[1]["content"]
    ref = ahd.get("tsp_constructive").reference()
    _, ret, done, _, info = env.step(f"```python\n{ref}```")
    assert done and info["error"] is None and ret == -info["length"] == info["best_score"]
    with pytest.raises(ValueError, match="env.problem='tsp_constructive'"):
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
