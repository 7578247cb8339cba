"""Ant colony solvers in numpy (all ants of an iteration advance together), seeded by a numpy Generator.

Parameters follow the paper's evaluators (EoH/ReEvo ``aco.py``): TSP and CVRP 30 ants, 100 iterations,
decay 0.9, alpha = beta = 1, pheromone 1 at start, every ant deposits 1/cost on its edges; offline bin
packing 20 ants, 15 iterations, decay 0.95, the heuristic clipped to [1e-6, 1e6] and scaled to max 1, an
item's attraction to the open bin the mean heuristic row of the bin's items, deposits the packing's fitness
(mean squared bin fill) / ants on every pair of items sharing a bin.

Untrusted heuristics: :func:`heuristic` bounds the matrix (an all-1e308 one would overflow pheromone x
heuristic to inf, then NaN, and the sampler would revisit nodes), and every ant's solution is checked
(:func:`check_tours`, :func:`check_routes`): a solver bug or a numeric escape fails the candidate, never
scores a non-solution.
"""
from __future__ import annotations

import numpy as np

from esopt_mp.envs.ahd.common import Failure

H_MIN, H_MAX = 1e-9, 1e9


def heuristic(heu: np.ndarray) -> np.ndarray:
    """The paper's ``heu + 1e-9`` floored at 1e-9, and also capped at 1e9 (pheromone x heuristic x n stays far
    below float64's range; a reasonable heuristic, e.g. 1/d, is unchanged)."""
    heu = np.asarray(heu, dtype=np.float64) + H_MIN
    if not np.all(np.isfinite(heu)):
        raise Failure("heuristics returned non-finite values")
    return np.clip(heu, H_MIN, H_MAX)


def check_tours(paths: np.ndarray) -> None:
    """Every row a permutation of the nodes."""
    if not (np.sort(paths, axis=1) == np.arange(paths.shape[1])).all():
        raise Failure("the ant colony built a tour that is not a permutation of the nodes")


def check_routes(paths: np.ndarray, demand: np.ndarray, capacity: float) -> None:
    """Every row visits each customer exactly once, starts and ends at the depot, loads within capacity."""
    n = len(demand)
    for path in paths:
        cust = path[path != 0]
        if path[0] != 0 or path[-1] != 0 or len(cust) != n - 1 or len(np.unique(cust)) != n - 1:
            raise Failure("the ant colony built a route that does not visit every customer exactly once")
        trip = np.cumsum(path == 0)  # the trip each step belongs to
        loads = np.bincount(trip, weights=demand[path])
        if loads.max() > capacity + 1e-9:
            raise Failure(f"the ant colony built a route over capacity ({loads.max():g} > {capacity:g})")


def _sample(weights: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One column index per row, with probability proportional to the row's non-negative weights."""
    cum = np.cumsum(weights, axis=1)
    u = rng.random(len(weights)) * cum[:, -1]
    idx = (cum <= u[:, None]).sum(1)
    idx = np.minimum(idx, weights.shape[1] - 1)
    bad = weights[np.arange(len(idx)), idx] <= 0  # rounding at the top end: take the last positive entry
    if bad.any():
        idx[bad] = weights.shape[1] - 1 - np.argmax(weights[bad][:, ::-1] > 0, axis=1)
    return idx


def tsp(dist: np.ndarray, heu: np.ndarray, rng: np.random.Generator, n_ants: int = 30, n_iterations: int = 100,
        decay: float = 0.9, alpha: float = 1.0, beta: float = 1.0) -> tuple[float, np.ndarray]:
    """(best tour length, best tour) of the colony."""
    n, heu = len(dist), heuristic(heu)
    pher, ants = np.ones_like(dist), np.arange(n_ants)
    best, best_tour = np.inf, None
    for _ in range(n_iterations):
        attract = pher ** alpha * heu ** beta
        paths = np.empty((n_ants, n), dtype=np.int64)
        paths[:, 0] = rng.integers(0, n, n_ants)
        free = np.ones((n_ants, n), dtype=bool)
        free[ants, paths[:, 0]] = False
        for t in range(1, n):
            paths[:, t] = _sample(attract[paths[:, t - 1]] * free, rng)
            free[ants, paths[:, t]] = False
        check_tours(paths)
        nxt = np.roll(paths, -1, axis=1)
        costs = dist[paths, nxt].sum(1)
        i = int(np.argmin(costs))
        if costs[i] < best:
            best, best_tour = float(costs[i]), paths[i].copy()
        pher *= decay
        np.add.at(pher, (paths, nxt), (1.0 / costs)[:, None])
        np.add.at(pher, (nxt, paths), (1.0 / costs)[:, None])
    return best, best_tour


def cvrp(dist: np.ndarray, demand: np.ndarray, capacity: float, heu: np.ndarray, rng: np.random.Generator,
         n_ants: int = 30, n_iterations: int = 100, decay: float = 0.9, alpha: float = 1.0,
         beta: float = 1.0) -> tuple[float, list[int]]:
    """(best route cost, best route as a node sequence from depot 0 back to 0, depot visits between trips)."""
    n, heu = len(dist), heuristic(heu)
    pher, ants = np.ones_like(dist), np.arange(n_ants)
    best, best_route = np.inf, None
    for _ in range(n_iterations):
        attract = pher ** alpha * heu ** beta
        cur = np.zeros(n_ants, dtype=np.int64)
        load = np.zeros(n_ants)
        todo = np.ones((n_ants, n), dtype=bool)
        todo[:, 0] = False
        steps = [cur.copy()]
        while todo.any() or (cur != 0).any():
            allowed = todo & (demand[None, :] <= (capacity - load)[:, None])
            allowed[:, 0] = (cur != 0) | ~todo.any(1)  # back to the depot, never depot to depot mid-route
            cur = _sample(attract[cur] * allowed, rng)
            load = np.where(cur == 0, 0.0, load + demand[cur])
            todo[ants, cur] = False
            todo[:, 0] = False
            steps.append(cur.copy())
        paths = np.stack(steps, 1)
        check_routes(paths, demand, capacity)
        moving = ~((paths[:, :-1] == 0) & (paths[:, 1:] == 0))  # finished ants wait at the depot: no cost
        costs = (dist[paths[:, :-1], paths[:, 1:]] * moving).sum(1)
        i = int(np.argmin(costs))
        if costs[i] < best:
            best = float(costs[i])
            best_route = [int(v) for k, v in enumerate(paths[i]) if k == 0 or v != 0 or paths[i][k - 1] != 0]
        pher *= decay
        for a in range(n_ants):
            m = moving[a]
            np.add.at(pher, (paths[a, :-1][m], paths[a, 1:][m]), 1.0 / costs[a])
        pher[pher < 1e-10] = 1e-10
    return best, best_route


def bpp(demand: np.ndarray, capacity: int, heu: np.ndarray, rng: np.random.Generator, n_ants: int = 20,
        n_iterations: int = 15, decay: float = 0.95, alpha: float = 1.0,
        beta: float = 1.0) -> tuple[int, np.ndarray]:
    """(fewest bins found, the bin of every item in that packing)."""
    n = len(demand)
    heu = np.clip(heu, 1e-6, 1e6)
    heu = np.maximum(heu / heu.max(), 1e-6)
    pher, ants = np.ones((n, n)), np.arange(n_ants)
    best, best_bins = n + 1, None
    for _ in range(n_iterations):
        attract = pher ** alpha * heu ** beta
        left = np.ones((n_ants, n), dtype=bool)
        vacancy = np.full(n_ants, float(capacity))
        row_sum = np.zeros((n_ants, n))
        count = np.zeros(n_ants, dtype=np.int64)
        bin_of = np.full((n_ants, n), -1, dtype=np.int64)
        n_bins = np.ones(n_ants, dtype=np.int64)
        fills = [[] for _ in range(n_ants)]
        for _ in range(n):
            fits = left & (demand[None, :] <= vacancy[:, None])
            full = ~fits.any(1)
            for a in np.nonzero(full)[0]:  # close the bin: the next item opens a new one
                fills[a].append(capacity - vacancy[a])
            n_bins += full
            vacancy[full], count[full], row_sum[full] = capacity, 0, 0.0
            fits[full] = left[full]
            opening = count == 0
            mean_row = row_sum / np.maximum(count, 1)[:, None]  # the open bin's items' mean attraction
            weights = np.where(opening[:, None], fits.astype(float), (mean_row + 1e-5) * fits)
            item = _sample(weights, rng)
            bin_of[ants, item] = n_bins - 1
            vacancy -= demand[item]
            left[ants, item] = False
            row_sum += attract[item]
            count += 1
        for a in range(n_ants):
            fills[a].append(capacity - vacancy[a])
        fitness = np.array([np.mean((np.array(f) / capacity) ** 2) for f in fills])
        i = int(np.argmin(n_bins))
        if n_bins[i] < best:
            best, best_bins = int(n_bins[i]), bin_of[i].copy()
        delta = np.zeros((n, n))
        for a in range(n_ants):
            delta += (bin_of[a][:, None] == bin_of[a][None, :]) * (fitness[a] / n_ants)
        pher = pher * decay + delta
    return best, best_bins
