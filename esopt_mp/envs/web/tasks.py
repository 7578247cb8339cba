"""WebArena-Lite task sets, their splits, which need an LLM judge, and the site preflight.

Task ids are WebArena's (``old_task_id`` in ``browsergym-webarenalite``'s
``test_webarena_lite.raw.json``; gym id ``browsergym/webarenalite.<id>``).
Split: ids with ``id % 5 == 0`` are held out (32 of 165), the rest train --
fixed by the id, so it never depends on the task order or the seed. Tasks whose
scorer calls an LLM (a ``fuzzy_match`` reference, scored by ``llm_fuzzy_match``
/ ``llm_ua_match``) need an OpenAI-compatible judge (``OPENAI_BASE_URL`` +
``OPENAI_API_KEY``); without one they are excluded and counted, never scored 0.

Their command line (a task set's counts, the site preflight, a run's own start check) is
``tools/webarena_tasks.py``.

Site state: WebArena-Lite's sites are shared by every member and step of a run and are never reset between
episodes (the benchmark has no per-episode reset); ``env.webarena_lite.full_reset`` resets them once at the run's start.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import urllib.error
import urllib.request

log = logging.getLogger(__name__)
SITES = ("shopping", "shopping_admin", "reddit", "gitlab", "wikipedia", "map", "homepage")
HELD_OUT_MOD = 5


def site_var(site: str) -> str:
    return f"WA_{site.upper()}"


def load_configs() -> list[dict]:
    """The 165 raw WebArena-Lite task configs (URLs still as ``__SHOPPING__`` placeholders)."""
    try:  # located, not imported: importing browsergym.webarena* looks up (or downloads) nltk data
        spec = importlib.util.find_spec("browsergym.webarenalite")
    except ModuleNotFoundError:
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("webarena_lite needs browsergym-webarenalite==0.14.3: python tools/setup_browser.py")
    with open(os.path.join(spec.submodule_search_locations[0], "test_webarena_lite.raw.json")) as f:
        return json.load(f)


def needs_judge(config: dict) -> bool:
    """Whether scoring calls an LLM (any ``fuzzy_match`` reference: llm_fuzzy_match / llm_ua_match)."""
    return '"fuzzy_match"' in json.dumps(config["eval"])


def answer_only(config: dict) -> bool:
    """Scored on the final answer alone (string_match): no site state is read by the evaluator."""
    return config["eval"]["eval_types"] == ["string_match"]


JUDGE_MODEL = "gpt-4-1106-preview"  # hard-coded by browsergym.webarenalite.helper_functions (llm_fuzzy_match)


def judge_available() -> bool:
    """$OPENAI_BASE_URL and $OPENAI_API_KEY set: the only names BrowserGym's judge client reads
    (webarena.llms.providers.openai_utils: ``openai.OpenAI(api_key=$OPENAI_API_KEY)``, base URL from the env)."""
    return bool(os.environ.get("OPENAI_BASE_URL")) and bool(os.environ.get("OPENAI_API_KEY"))


def judge_preflight(timeout_s: float = 10.0) -> list[str]:
    """The judge answers ``GET $OPENAI_BASE_URL/models`` with the key and serves :data:`JUDGE_MODEL`; its model ids.

    BrowserGym asks for that model name whatever the server is: serve the judge under it (vLLM:
    ``--served-model-name gpt-4-1106-preview``).
    """
    base = os.environ["OPENAI_BASE_URL"].rstrip("/")
    req = urllib.request.Request(f"{base}/models", headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            ids = [m.get("id") for m in json.load(r).get("data", [])]
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"webarena_lite preflight: the LLM judge (OPENAI_BASE_URL={base}) answers HTTP {e.code} "
                           "to GET /models") from None
    except (OSError, ValueError, AttributeError) as e:
        raise RuntimeError(f"webarena_lite preflight: the LLM judge (OPENAI_BASE_URL={base}) is unreachable or not "
                           f"OpenAI-compatible: {getattr(e, 'reason', e)}") from None
    if JUDGE_MODEL not in ids:
        raise RuntimeError(f"webarena_lite preflight: the LLM judge at {base} does not serve {JUDGE_MODEL!r} (the "
                           f"name BrowserGym asks for; it serves {ids[:5]}): serve the judge under that name")
    return ids


def split_ids(ids, split: str) -> list[int]:
    if split == "all":
        return sorted(ids)
    held = split == "heldout"
    return sorted(i for i in ids if (i % HELD_OUT_MOD == 0) == held)


def select(task_ids=(), split: str = "all", only_answer: bool = False, judge: bool | None = None,
           configs: list[dict] | None = None) -> tuple[list[dict], dict]:
    """(tasks, counts): the chosen WebArena-Lite tasks as environment task dicts, and how many were excluded why.

    ``judge``: whether an LLM judge is configured (None: read the environment).
    """
    configs = configs if configs is not None else load_configs()
    by_id = {c["old_task_id"]: c for c in configs}
    unknown = sorted(set(task_ids) - set(by_id))
    if unknown:
        raise ValueError(f"env.webarena_lite.task_ids: unknown WebArena-Lite task ids {unknown}")
    ids = split_ids(task_ids or by_id, split)
    judge = judge_available() if judge is None else judge
    counts = {"selected": len(ids), "excluded_needs_judge": 0, "excluded_not_answer_only": 0}
    tasks = []
    for i in ids:
        c = by_id[i]
        if only_answer and not answer_only(c):
            counts["excluded_not_answer_only"] += 1
        elif needs_judge(c) and not judge:
            counts["excluded_needs_judge"] += 1
        else:
            tasks.append({"id": f"webarenalite.{i}", "gym_id": f"browsergym/webarenalite.{i}",
                          "sites": list(c["sites"]), "intent": c["intent"], "judged": needs_judge(c)})
    counts["kept"] = len(tasks)
    if counts["excluded_needs_judge"]:
        log.warning("webarena_lite: %d tasks need an LLM judge (OPENAI_BASE_URL + OPENAI_API_KEY unset): excluded",
                    counts["excluded_needs_judge"])
    return tasks, counts


def preflight(sites, timeout_s: float = 10.0) -> dict:
    """Check that every WebArena variable is set and every site in ``sites`` answers; raise naming the first gap.

    BrowserGym's WebArena instance needs all ``WA_*`` variables even for one site (it asserts at reset).
    """
    for s in SITES:
        if not os.environ.get(site_var(s)):
            raise RuntimeError(f"webarena_lite preflight: {site_var(s)} is not set (the {s} site's URL; "
                               f"BrowserGym needs all of {', '.join(map(site_var, SITES))})")
    seen = {}
    for s in sorted(set(sites)):
        url = os.environ[site_var(s)]
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="GET"), timeout=timeout_s) as r:
                seen[s] = r.status
        except urllib.error.HTTPError as e:  # an HTTP answer: the site is up (a login wall may say 401/403)
            if e.code >= 500:
                raise RuntimeError(f"webarena_lite preflight: site {s} ({site_var(s)}={url}) answers HTTP {e.code}") from None
            seen[s] = e.code
        except (OSError, ValueError) as e:
            raise RuntimeError(f"webarena_lite preflight: site {s} ({site_var(s)}={url}) is unreachable: "
                               f"{getattr(e, 'reason', e)}") from None
    return seen


def load_split(env_cfg, web) -> tuple[list[dict], list[dict]]:
    """(train, held-out) tasks for ``env`` (an ``EnvConfig``) and its ``webarena_lite`` section ``web``.

    ``web.split=all`` (the default): train on the train split, evaluate on the held-out one;
    ``train``/``heldout``: both sets from that one split. ``suite=demo``: the loopback demo tasks.
    """
    if web.suite == "demo":
        from esopt_mp.envs.web import demo

        return demo.tasks(env_cfg.n_train), demo.tasks(env_cfg.n_eval, first_seed=10_000)
    judge = judge_available()
    splits = ("train", "heldout") if web.split == "all" else (web.split, web.split)
    train, c_train = select(web.task_ids, splits[0], web.answer_only, judge)
    held, c_held = select(web.task_ids, splits[1], web.answer_only, judge)
    log.info("webarena_lite tasks: train %s, held-out %s", c_train, c_held)
    train, held = train[: env_cfg.n_train], held[: env_cfg.n_eval]
    if len(train) < env_cfg.episodes_per_step or not held:
        raise ValueError(f"env.webarena_lite: {len(train)} training and {len(held)} held-out WebArena-Lite tasks "
                         f"(split={web.split}, task_ids={web.task_ids or 'all'}; excluded: train {c_train}, "
                         f"held-out {c_held}) are not enough for env.episodes_per_step={env_cfg.episodes_per_step}")
    return train, held


def startup_check(env_cfg, web, reset: bool = True) -> None:
    """At the trainer's start on TP leaders: the browser stack, then (WebArena) every site the tasks need
    (``reset``: the sites' full reset first where ``env.webarena_lite.full_reset`` asks for it)."""
    from esopt_mp.envs.web.stack import check

    check(web.chromium, web.browsers_path, web.nltk_data)
    if web.suite == "webarena_lite":
        train, held = load_split(env_cfg, web)
        if reset and web.full_reset:
            full_reset()
        preflight({s for t in train + held for s in t["sites"]}, web.preflight_timeout_s)
        if any(t["judged"] for t in train + held):
            judge_preflight(web.preflight_timeout_s)


def full_reset() -> None:
    """BrowserGym's WebArena full reset (``WebArenaInstance.full_reset``): every site back to its initial state."""
    if not os.environ.get("WA_FULL_RESET"):
        raise RuntimeError("env.webarena_lite.full_reset: WA_FULL_RESET is not set (the base URL of the WebArena instance's "
                           "reset server: BrowserGym calls $WA_FULL_RESET/reset and /status)")
    from browsergym.webarena.instance import WebArenaInstance

    log.info("webarena_lite: full reset of the WebArena sites via %s (minutes)", os.environ["WA_FULL_RESET"])
    WebArenaInstance().full_reset(skip_if_not_set=False)
