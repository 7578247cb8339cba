"""Does a shape fit? Checked from the meta model's parameter count before anything is allocated.

Uses :func:`esopt_mp.profiling.memmodel.predict` when that module is present;
otherwise a bound written here: bytes per parameter for each profile, times a
1.2 margin for activations, KV state and allocator slack.
"""
from __future__ import annotations

GB = 1e9
MARGIN = 1.2
# (per-rank device bytes per local parameter, host-by-design bytes per local parameter)
_BOUND = {
    "inference": (2, 0), "es_subtract": (2, 0), "es_snapshot": (2, 2), "es_snapshot_fp32_host": (2, 4),
    # bf16 weights + bf16 grads + fp32 master + two fp32 Adam moments + bf16 frozen reference (+ value head)
    "grpo": (20, 0), "ppo": (20, 0),
}


def _predict(config, profile: str, tp: int, wl, device: str):
    try:
        from esopt_mp.profiling.memmodel import predict
    except ImportError:
        return None
    from esopt_mp.profiling.profiles import ES_MODES

    algo, restore, master = profile, "subtract", "none"
    if profile in ES_MODES:
        algo = "es"
        restore, master = ES_MODES[profile]
    p = predict(config, algo=algo, tp=tp, batch=wl.batch, context=wl.context, new_tokens=wl.new_tokens,
                restore=restore, master=master, device=device)
    return p.device_total, p.host_total


def need_bytes(config, params: int, profile: str, tp: int, wl, device: str) -> tuple[int, int, str]:
    """(per-rank device bytes, per-rank host-by-design bytes, which estimate) for ``profile``."""
    pred = _predict(config, profile, tp, wl, device)
    if pred is not None:
        return int(pred[0]), int(pred[1]), "memmodel.predict"
    dev, host = _BOUND[profile]
    local = params / tp
    return int(local * dev * MARGIN), int(local * host), f"bound: {dev} B/param device, {host} B/param host, x{MARGIN}"


def check_fits(shape: str, config, params: int, profiles, tp: int, local_ranks: int, wl, *,
               cuda_free: int | None, host_available: int) -> str | None:
    """None if every profile fits, else one line saying what the largest needs and what is available.

    On a CPU all ranks of this host share its RAM (device-equivalent and host
    bytes add up); on a GPU each rank's device bytes go against its GPU's free
    memory and the host-by-design bytes of all local ranks against the RAM.
    The checkpoint written first holds the whole model once (bf16) in one process.
    """
    worst = None
    for prof in profiles:
        dev, host, how = need_bytes(config, params, prof, tp, wl, "cuda" if cuda_free is not None else "cpu")
        if cuda_free is None:
            need, avail, where = max((dev + host) * local_ranks, int(params * 2 * MARGIN)), host_available, "host memory"
        elif dev > cuda_free:
            need, avail, where = dev, cuda_free, "GPU memory per rank"
        else:
            need, avail, where = max(host * local_ranks, int(params * 2 * MARGIN)), host_available, "host memory"
        if need > avail and (worst is None or need - avail > worst[0] - worst[1]):
            worst = (need, avail, where, prof, how)
    if worst is None:
        return None
    need, avail, where, prof, how = worst
    return (f"shape {shape} needs ~{need / GB:.1f} GB of {where} for profile {prof} at tp={tp} "
            f"({params / 1e9:.2f} B params, bf16 weights {params * 2 / GB:.1f} GB; {how}), "
            f"{avail / GB:.1f} GB available: nothing allocated")
