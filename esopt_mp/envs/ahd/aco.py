"""Ant colony solvers in numpy (all ants of an iteration advance together), seeded by a numpy Generator.

Parameters follow the paper's evaluators (EoH/ReEvo ``aco.py``): TSP and CVRP 30 ants, 100 iterations,
decay 0.9, alpha = beta = 1, pheromone 1 at start, every ant deposits 1/cost on its edges; offline bin
packing 20 ants, 15 iterations, decay 0.95, the heuristic clipped to [1e-6, 1e6] and scaled to max 1, an
item's attraction to the open bin the mean heuristic row of the bin's items, deposits the packing's fitness
(mean squared bin fill) / ants on every pair of items sharing a bin; beside it the paper's "sample" mode
(:func:`bpp_sample`: 200 packings from the heuristic alone, greedy within a bin).

Untrusted heuristics: :func:`clean` applies the paper's evaluators' rules (NaN -> 1e-9, +inf -> 1e9, -inf ->
1e-9, anything below 1e-9 raised to 1e-9); the TSP / CVRP colonies then scale each row by a power of two
(:func:`row_scaled`: exact, so every sampling probability is unchanged, and an all-1e308 matrix cannot
overflow pheromone x heuristic to inf, then NaN, and make the sampler revisit nodes), and every ant's solution
is checked (:func:`check_tours`, :func:`check_routes`): a solver bug or a numeric escape fails the candidate,
never scores a non-solution.
"""
from __future__ import annotations

import numpy as np

from esopt_mp.envs.ahd.common import Failure

H_MIN, H_MAX = 1e-9, 1e9


def clean(heu: np.ndarray) -> np.ndarray:
    """The paper's cleaning of a returned heuristic matrix: NaN -> 1e-9, +inf -> 1e9, -inf -> 1e-9, and every
    value below 1e-9 raised to 1e-9 (finite large values are kept)."""
    heu = np.nan_to_num(np.asarray(heu, dtype=np.float64), nan=H_MIN, posinf=H_MAX, neginf=H_MIN)
    return np.maximum(heu, H_MIN)


def row_scaled(heu: np.ndarray) -> np.ndarray:
    """Each row divided by a power of two near its maximum: exact in floating point (the sampling probabilities
    pheromone x heuristic / row sum do not change), and pheromone x heuristic summed over a row stays finite."""
    _, exp = np.frexp(heu.max(axis=1, keepdims=True))
    return np.ldexp(heu, -exp)


def check_tours(paths: np.ndarray) -> None:
    """Every row a permutation of the nodes."""
    if not (np.sort(paths, axis=1) == np.arange(paths.shape[1])).all():
        raise Failure("the ant colony built a tour that is not a permutation of the nodes")


def check_routes(paths: np.ndarray, demand: np.ndarray, capacity: float) -> None:
    """Every row visits each customer exactly once, starts and ends at the depot, loads within capacity."""
    n, (ants, steps) = len(demand), paths.shape
    rows = np.repeat(np.arange(ants), steps)
    visits = np.zeros((ants, n), dtype=np.int64)
    np.add.at(visits, (rows, paths.reshape(-1)), 1)
    if (paths[:, 0] != 0).any() or (paths[:, -1] != 0).any() or (visits[:, 1:] != 1).any():
        raise Failure("the ant colony built a route that does not visit every customer exactly once")
    trip = np.cumsum(paths == 0, axis=1)  # the trip each step belongs to
    loads = np.zeros((ants, steps + 1))
    np.add.at(loads, (rows, trip.reshape(-1)), demand[paths].reshape(-1))
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
    n, heu = len(dist), row_scaled(clean(heu))
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
    n, heu = len(dist), row_scaled(clean(heu))
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
        # every ant's moves in ant order (row-major), as one call: the same additions in the same order
        np.add.at(pher, (paths[:, :-1][moving], paths[:, 1:][moving]),
                  np.broadcast_to((1.0 / costs)[:, None], moving.shape)[moving])
        pher[pher < 1e-10] = 1e-10
    return best, best_route


def bpp_heuristic(heu: np.ndarray) -> np.ndarray:
    """The bin-packing colony's heuristic: cleaned (:func:`clean`), clipped to [1e-6, 1e6], scaled to max 1,
    floored at 1e-6 (the paper's evaluator)."""
    heu = np.clip(clean(heu), 1e-6, 1e6)
    return np.maximum(heu / heu.max(), 1e-6)


def _packings(k: int, n: int, capacity: int):
    """``k`` empty packings of ``n`` items, built side by side: (items left, the open bin's vacancy, the sum of
    its items' heuristic rows, its item count, each item's bin, bins opened)."""
    return (np.ones((k, n), dtype=bool), np.full(k, float(capacity)), np.zeros((k, n)), np.zeros(k, dtype=np.int64),
            np.full((k, n), -1, dtype=np.int64), np.ones(k, dtype=np.int64))


def bpp_sample(demand: np.ndarray, capacity: int, heu: np.ndarray, rng: np.random.Generator,
               n_samples: int = 200) -> tuple[int, np.ndarray]:
    """(fewest bins, the bin of every item in that packing) over ``n_samples`` packings built from the heuristic
    alone (the paper's "sample" mode: no pheromone): a bin's first item is drawn uniformly among the remaining
    items that fit, every next one is the fitting item of the highest mean heuristic row over the bin's items
    (+ 1e-5; ties: the lowest index); a bin closes when no remaining item fits it. All samples advance together.
    """
    n, heu = len(demand), bpp_heuristic(heu)
    rows = np.arange(n_samples)
    left, vacancy, row_sum, count, bin_of, n_bins = _packings(n_samples, n, capacity)
    for _ in range(n):
        fits = left & (demand[None, :] <= vacancy[:, None])
        full = ~fits.any(1)
        n_bins += full
        vacancy[full], count[full], row_sum[full] = capacity, 0, 0.0
        fits[full] = left[full]
        opening = count == 0
        score = (row_sum / np.maximum(count, 1)[:, None] + 1e-5) * fits
        item = np.argmax(score, axis=1)
        if opening.any():  # uniform among the fitting items: the r-th True of the row
            k = fits[opening].sum(1)
            r = rng.integers(0, k)
            item[opening] = np.argmax(np.cumsum(fits[opening], axis=1) > r[:, None], axis=1)
        bin_of[rows, item] = n_bins - 1
        vacancy -= demand[item]
        left[rows, item] = False
        row_sum += heu[item]
        count += 1
    i = int(np.argmin(n_bins))
    return int(n_bins[i]), bin_of[i].copy()


def bpp(demand: np.ndarray, capacity: int, heu: np.ndarray, rng: np.random.Generator, n_ants: int = 20,
        n_iterations: int = 15, decay: float = 0.95, alpha: float = 1.0,
        beta: float = 1.0) -> tuple[int, np.ndarray]:
    """(fewest bins found, the bin of every item in that packing)."""
    n = len(demand)
    heu = bpp_heuristic(heu)
    pher, ants = np.ones((n, n)), np.arange(n_ants)
    best, best_bins = n + 1, None
    for _ in range(n_iterations):
        attract = pher ** alpha * heu ** beta
        left, vacancy, row_sum, count, bin_of, n_bins = _packings(n_ants, n, capacity)
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
