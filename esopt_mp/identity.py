"""A run's identity: the config hash of what determines its weights, by content (no path enters it).

The hash must not change when the same model or task file is found under another path (another node's mount,
``ESOPT_DATA``), and must change when their content does. Checkpoints and the ledger store it; a resume compares it.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import struct

from esopt_mp.core.files import file_sha256

# small files that decide how the model is built and how text becomes tokens
MODEL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
               "special_tokens_map.json", "vocab.json", "merges.txt")
SAMPLES = 16  # 64 KiB blocks read per safetensors file, spread over its data
# objective.* fields of objective.name=harness (popped from the identity of every other objective)
HARNESS_FIELDS = ("callable", "command", "concurrency", "tasks", "eval_tasks", "timeout_s", "failure_return", "env",
                  "openai_env")


def safetensors_fingerprint(path: str, samples: int = SAMPLES, block: int = 1 << 16) -> str:
    """Digest of a safetensors file's header (names, dtypes, shapes, offsets), size and ``samples`` data blocks.

    Reading a few evenly spread blocks instead of the whole file keeps this
    cheap for a 50 GB checkpoint while any fine-tune (which changes nearly every
    weight) still changes it.
    """
    h = hashlib.sha256()
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise ValueError(f"{path}: truncated safetensors header ({n} bytes declared, file of {size})")
        h.update(head + f.read(n) + str(size).encode())
        data0, data_len = 8 + n, size - 8 - n
        if data_len <= samples * block:
            h.update(f.read())
            return h.hexdigest()
        for i in range(samples):  # first and last block included
            f.seek(data0 + (data_len - block) * i // (samples - 1))
            h.update(f.read(block))
    return h.hexdigest()


def model_fingerprint(model_dir: str) -> str:
    """Identity of an HF model directory by content: its config/tokenizer files and every weight file's fingerprint."""
    h = hashlib.sha256()
    for name in MODEL_FILES:
        p = os.path.join(model_dir, name)
        if os.path.isfile(p):
            h.update(f"{name}:{file_sha256(p)}\n".encode())
    weights = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not weights and not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(f"model.path: {model_dir} holds neither config.json nor *.safetensors")
    for p in weights:
        h.update(f"{os.path.basename(p)}:{safetensors_fingerprint(p)}\n".encode())
    return h.hexdigest()


def diff_identity(old: dict, new: dict, limit: int = 6) -> str:
    """The settings two identities (flat dicts of dotted keys) disagree on: ``"es.population 8 -> 4; ..."``."""
    keys = sorted(k for k in set(old) | set(new) if old.get(k, "<unset>") != new.get(k, "<unset>"))

    def show(v) -> str:
        s = json.dumps(v) if not isinstance(v, str) else v
        return s if len(s) <= 40 else s[:16] + "..."

    parts = [f"{k} {show(old.get(k, '<unset>'))} -> {show(new.get(k, '<unset>'))}" for k in keys[:limit]]
    if len(keys) > limit:
        parts.append(f"and {len(keys) - limit} more")
    return "; ".join(parts)


def recorded_difference(run_dir: str, fields: dict) -> str:
    """What ``fields`` (an identity's) changes against the identity ``run_dir/config.json`` recorded: ``""`` when
    none is recorded (or it cannot be read) or nothing differs."""
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            old = json.load(f).get("identity")
    except (OSError, ValueError):
        return ""
    return diff_identity(old, fields) if isinstance(old, dict) else ""


def digest(fields: dict) -> str:
    """The config hash of a nested dict of hashed settings (16 hex digits of a SHA-256 of its sorted JSON)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def held_out_key(cfg) -> str:
    """What a held-out score depends on besides the weights: every setting but ``run.*`` (its seed kept), layout
    and paths included, and the held-out file (``env.eval_path``) by content. A resumed run reuses a score recorded
    at its step under the same key; another setting (``env.n_eval``, a ``parallel.tp`` whose reductions round
    differently, an eval file another data root resolves to) evaluates again. Files an environment's own section
    names count by their path, not their content."""
    from esopt_mp.data import resolve

    d = cfg.to_dict()
    d["run"] = {"seed": d["run"]["seed"]}
    if cfg.env.eval_path:
        try:
            d["env"]["eval_path"] = file_sha256(resolve(cfg.env.eval_path))
        except (OSError, ValueError):  # kept by name: the evaluation itself says what is wrong with it
            pass
    return digest(d)


def config_hash(cfg, model_dir: str | None = None) -> str:
    """The hash of what determines a run's weights (:func:`identity_fields`); a requeue may change anything else.

    ``cfg``: a :class:`~esopt_mp.config.TrainConfig`; ``model_dir``: the resolved model directory, if any.
    """
    return digest(identity_fields(cfg, model_dir))


def config_identity(cfg, model_dir: str | None = None) -> dict:
    """{"hash": :func:`config_hash`, "fields": the hashed settings as dotted keys}: stored so a refusal names them."""
    d = identity_fields(cfg, model_dir)
    flat: dict = {}

    def walk(prefix: str, v) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else k, x)
        else:
            flat[prefix] = v

    walk("", d)
    return {"hash": digest(d), "fields": flat}


def identity_fields(cfg, model_dir: str | None = None) -> dict:
    """What determines the weights, as a nested dict: a requeue may change anything else (layout, eval, paths).

    In: ``run.seed`` (as ``es.seed``), ``es.*`` (population, schedules, shaping, precision modes,
    selection), ``model.dtype``, the model by content (fingerprint of
    ``model_dir``, the resolved model directory, else of ``model.path``;
    ``model.tiny`` when the tiny model is built), ``objective.*`` (a harness's ``objective.tasks`` by content;
    not its ``timeout_s``, ``concurrency``, ``eval_tasks``, ``env`` nor ``openai_env``), the
    training tasks by content (SHA-256 of ``env.train_path``, or the
    generator settings ``n_train``/``task_seed``), the named environment's section as its spec hashes it
    (``EnvSpec.identity``; not the sections of other environments),
    every other ``env.*`` setting that shapes training returns (``max_episode_tokens`` and ``common_draws`` when
    set: their defaults keep the hash of runs from before them),
    ``engine.*`` (training sampling; not vllm's memory budget, weight_sync, enforce_eager, max_model_len) and
    ``algo.*`` (which trainer, its lr, KL, clip...). New fields are in by default.
    Out: the rest of ``run.*``, ``endpoint.*`` and ``parallel.*`` (noise and updates are layout-invariant,
    tests/distributed), ``es.chunk_elems`` and ``es.noise_backend`` (bit-neutral:
    test_update_matches_dense_formula_and_chunking_is_bitwise_neutral,
    test_compiled_kernel_is_bit_identical_to_eager, test_perturb_restore_update_equal_eager), held-out evaluation
    (``env.n_eval``/``eval_path``/``eval_repeats``/``eval_temperature``:
    training tasks never depend on them), ``env.episode_timeout_s`` and ``env.env_workers`` (wall clock and
    threads: a requeue on other hardware may need other values), the sandbox's isolation level
    (``env.sandbox.level``/``min_level``: a requeue may land on a node with
    another level; the limits stay in) and every path string.
    """
    d = cfg.to_dict()
    d["es"]["seed"] = d.pop("run")["seed"]  # hashed where it was before run.seed: earlier runs keep their hash
    d.pop("parallel")
    d.pop("endpoint")  # where and how fast a member is served, never what it answers
    for k in ("chunk_elems", "noise_backend"):
        d["es"].pop(k)
    if d["es"].get("noise") == "full":  # the default: runs from before es.noise keep their hash (rank unused)
        d["es"].pop("noise"), d["es"].pop("rank")
    if not d["es"].get("member_batch"):  # in: members in one batch round differently from members in turn
        d["es"].pop("member_batch")
    if d["es"].get("decay_to") == "zero":  # the default: runs from before es.decay_to keep their hash
        d["es"].pop("decay_to")
    eng = d["engine"]  # the engine's rollout settings; not where the weights live nor how fast it serves
    for k in ("weight_sync", "gpu_memory_utilization", "kv_cache_gib", "enforce_eager", "max_model_len"):
        eng.pop(k)
    if eng["name"] != "hf":
        eng.pop("prefix_reuse")
    tiny = d["model"]["tiny"]
    if tiny["arch"] == "qwen3_5" and tiny["head_dim"] == 16:  # the defaults: runs started before these two
        tiny.pop("arch"), tiny.pop("head_dim")  # fields existed keep their hash (and their resume)
    for k in ("n_eval", "eval_path", "eval_repeats", "eval_temperature", "episode_timeout_s", "env_workers"):
        d["env"].pop(k)  # held-out evaluation; how long / how many threads episodes may take
    obj = d["objective"]  # a harness's settings: only its runs have them; wall clock and concurrency never count
    harness = ("concurrency", "timeout_s", "eval_tasks", "env", "openai_env")  # the node's, not the weights'
    for k in harness if cfg.objective.served else HARNESS_FIELDS:
        obj.pop(k)
    if obj.get("tasks"):  # the training tasks by content, as env.train_path
        from esopt_mp.data import resolve

        obj["tasks"] = file_sha256(resolve(obj["tasks"]))
    if d["prompt"]["optimiser"] == "none":  # the default: runs started before prompt.* keep their hash
        d.pop("prompt")
    elif d["prompt"]["optimiser"] != "skill":  # sample / eoh runs keep the hash they had before prompt.skill
        d["prompt"].pop("skill")
    else:  # which variable holds the key and how long a request may take, not what the endpoint answers
        d["prompt"]["skill"].pop("key_env"), d["prompt"]["skill"].pop("timeout_s")
    if not cfg.env.max_episode_tokens:  # no budget: runs from before the field keep their hash
        d["env"].pop("max_episode_tokens")
    if not cfg.env.common_draws:  # each member's own draws, the default: runs from before the field keep theirs
        d["env"].pop("common_draws")
    for k in ("level", "min_level"):  # where untrusted code may run, not what it returns
        d["env"]["sandbox"].pop(k, None)
    for k in cfg.env.sections:  # the named environment's section, as that environment hashes it
        d["env"].pop(k, None)
    d["env"].update(cfg.env.spec.identity(cfg.env.section))
    if cfg.env.train_path:
        from esopt_mp.data import resolve

        d["env"]["train_path"] = file_sha256(resolve(cfg.env.train_path))
    path = d["model"].pop("path")
    if path:
        d["model"].pop("tiny")
    where = model_dir or path
    if where and os.path.isdir(where):
        d["model"]["content"] = model_fingerprint(where)
    elif where:
        d["model"]["name"] = where  # "builtin:<name>" or a hub id: a name, not a filesystem path
    return d
