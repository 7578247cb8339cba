"""reasoning-gym's procedural datasets as an environment: its questions, its answer format, its own scores.

``env.name=reasoning_gym env.reasoning_gym.dataset=leg_counting`` trains on one of the library's datasets (any
name it registers); ``dataset=composite`` with ``weights={leg_counting: 1, basic_arithmetic: 2}`` on its
weighted composite. Tasks come from the library's own seeded generator; the model answers as the library's
system prompt asks (``<answer>...</answer>``), the answer is read the library's way (``utils.extract_answer``)
and the reward is the dataset's own ``score_answer`` (a float in [0, 1]).

``answer_format`` says how the answer is read. ``tags`` (the default) is the library's own form. A small model rarely
writes tags, so ``line`` asks for a final ``Answer: X`` line and reads the last such line, and ``lenient`` reads that
line or, without one, the last number in the reply. The form alone earns nothing: the library scores what was read.

``attempts > 1`` makes it multi-turn: after an answer that does not score 1, the user message gives its score
and asks again, until an answer scores 1 or the attempts are used up. Each step's reward is that attempt's
score and the episode's return is the last step's: the score of the final attempt, the answer the model settles
on after the feedback (not the best of its tries, which would reward scattering guesses for partial credit).
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import re
import threading
from typing import Any

from esopt_mp.chat.format import clean_text

NAME = "reasoning_gym"
STRIDE = 2 ** 20  # library seeds per (split, seed): entry i is drawn from Random(seed + i), see _library_seed
_OWN = ("seed", "size")  # dataset settings the task source sets itself
_SHOWN = 200  # characters of an answer kept in the step's info
FORMATS = ("tags", "line", "lenient")  # how the answer is read; see read_answer
LINE_PROMPT = ("Answer the question. You may reason first. End your reply with one final line of the form\n"
               "Answer: <your answer>\nwith nothing after it.")
_LINE = re.compile(r"^[ \t>*_#`-]*answer[ \t]*[*_]*[ \t]*[:=](.*)$", re.IGNORECASE | re.MULTILINE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _library():
    import reasoning_gym  # noqa: F401 - registers every dataset
    from reasoning_gym import factory, utils

    return factory, utils


def _names() -> list[str]:
    """The library's procedural datasets (its composite aside)."""
    return sorted(n for n in _library()[0].DATASETS if n != "composite")


def _unknown(name: str, where: str) -> ValueError:
    names = _names()
    close = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
    hint = f"close: {', '.join(close)}" if close else f"e.g. {', '.join(names[:5])}"
    return ValueError(f"{where}: reasoning_gym has no dataset {name!r} ({hint}; {len(names)} in all)")


def _check_settings(name: str, settings: Any, where: str) -> None:
    """``settings`` are keyword arguments the dataset's own config dataclass accepts and validates."""
    if not isinstance(settings, dict):
        raise ValueError(f"{where}: expected a mapping of {name}'s settings, got {settings!r}")
    cls = _library()[0].DATASETS[name][1]
    known = sorted(f.name for f in dataclasses.fields(cls) if f.name not in _OWN)
    for k in settings:
        if k in _OWN:
            raise ValueError(f"{where}.{k}: set by the task source (env.task_seed, env.n_train, env.n_eval)")
        if k not in known:
            raise ValueError(f"{where}: {name} has no setting {k!r}; its settings: {', '.join(known)}")
    try:
        cfg = cls(**settings)
        if callable(getattr(cfg, "validate", None)):
            cfg.validate()
    except (AssertionError, ValueError, TypeError) as e:
        raise ValueError(f"{where}: {name} refuses {settings}: {e or type(e).__name__}") from None


@dataclasses.dataclass
class ReasoningGymConfig:
    """The ``env.reasoning_gym`` section."""

    dataset: str = "leg_counting"  # a dataset the library registers, or "composite" (with weights)
    config: dict[str, Any] = dataclasses.field(default_factory=dict)  # the dataset's own settings, e.g.
    # {max_animals: 4}; for a composite, dataset name -> its settings
    weights: dict[str, float] = dataclasses.field(default_factory=dict)  # composite: dataset name -> weight
    attempts: int = 1  # answers per task; after a wrong one the model is told its score and asked again
    system_prompt: str = "default"  # one of the library's SYSTEM_PROMPTS, or a prompt naming <answer>...</answer>
    # (with answer_format line/lenient: "default" is a prompt asking for a final "Answer: X" line, or your own)
    answer_format: str = "tags"  # tags: the library's <answer>...</answer>; line: a final "Answer: X" line;
    # lenient: that line, else the reply's last number

    def validate(self, key: str = f"env.{NAME}") -> None:
        if self.attempts < 1:
            raise ValueError(f"{key}.attempts: must be >= 1, got {self.attempts}")
        if self.answer_format not in FORMATS:
            raise ValueError(f"{key}.answer_format: one of {', '.join(FORMATS)}, got {self.answer_format!r}")
        prompts = _library()[1].SYSTEM_PROMPTS
        if self.answer_format != "tags":
            if self.system_prompt != "default" and "answer:" not in self.system_prompt.lower():
                raise ValueError(f"{key}.system_prompt: with answer_format={self.answer_format} use \"default\" or a "
                                 "prompt that asks for a final \"Answer: ...\" line (the library's prompts ask for "
                                 "<answer> tags)")
        elif self.system_prompt not in prompts and "<answer>" not in self.system_prompt:
            raise ValueError(f"{key}.system_prompt: one of {', '.join(prompts)}, or a prompt that asks for the "
                             "answer as <answer>...</answer> (what the library scores)")
        if not isinstance(self.config, dict) or not isinstance(self.weights, dict):
            raise ValueError(f"{key}: config and weights must be mappings")
        if self.dataset != "composite":
            if self.weights:
                raise ValueError(f"{key}.weights: set only with dataset=composite (got dataset={self.dataset})")
            if self.dataset not in _names():
                raise _unknown(self.dataset, f"{key}.dataset")
            _check_settings(self.dataset, self.config, f"{key}.config")
            return
        if not self.weights:
            raise ValueError(f"{key}.weights: dataset=composite needs weights, e.g. {{leg_counting: 1, "
                             "basic_arithmetic: 2}")
        for name, weight in self.weights.items():
            if name not in _names():
                raise _unknown(name, f"{key}.weights")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
                raise ValueError(f"{key}.weights.{name}: must be a positive number, got {weight!r}")
        for name, settings in self.config.items():
            if name not in self.weights:
                raise ValueError(f"{key}.config.{name}: a composite's settings are per dataset, and {name!r} has "
                                 f"no weight (weights: {', '.join(self.weights)})")
            _check_settings(name, settings, f"{key}.config.{name}")


def _library_seed(split: str, seed: int) -> int:
    """The library's seed of ``tasks(split, n, seed)``: entry i is drawn from ``Random(seed + i)``, so seeds s and
    s + 1 (the runtime's train and eval) would share all entries but one; each (split, seed) takes its own
    block of STRIDE seeds."""
    return (2 * seed + (split == "eval")) * STRIDE


def _source(dataset: str, config: dict, weights: dict, seed: int, size: int) -> dict:
    """What rebuilds the library's dataset: a JSON object."""
    src = {"dataset": dataset, "seed": seed, "size": size}
    if dataset == "composite":
        src["datasets"] = [{"name": n, "weight": float(w), "config": dict(config.get(n, {}))} for n, w in
                           weights.items()]
    else:
        src["config"] = dict(config)
    return src


_CACHE: dict[str, Any] = {}  # source JSON -> the library's dataset (recent ones; building one can read files)
_CACHE_LOCK = threading.Lock()
_CACHE_SIZE = 8


def _dataset(src: dict):
    """The library's dataset of ``src`` (built by its own ``create_dataset``; the composite from its specs)."""
    key = json.dumps(src, sort_keys=True)
    with _CACHE_LOCK:
        if key in _CACHE:
            return _CACHE[key]
    factory, _ = _library()
    if src["dataset"] == "composite":
        from reasoning_gym.composite import DatasetSpec

        specs = [DatasetSpec(name=d["name"], weight=d["weight"], config=dict(d["config"])) for d in src["datasets"]]
        ds = factory.create_dataset("composite", seed=src["seed"], size=src["size"], datasets=specs)
    else:
        ds = factory.create_dataset(src["dataset"], seed=src["seed"], size=src["size"], **src["config"])
    with _CACHE_LOCK:
        _CACHE[key] = ds
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
    return ds


# (source JSON, index) -> the library's entry: a process plays its tasks again and again, and some generators
# take seconds an entry
_ENTRIES: dict[tuple[str, int], dict] = {}
_ENTRIES_SIZE = 4096


def _entry(src: dict, index: int) -> dict:
    """Entry ``index`` of the library's dataset of ``src`` (a copy: an episode cannot change another's)."""
    key = (json.dumps(src, sort_keys=True), index)
    with _CACHE_LOCK:
        entry = _ENTRIES.get(key)
    if entry is None:
        entry = _dataset(src)[index]
        with _CACHE_LOCK:
            _ENTRIES[key] = entry
            while len(_ENTRIES) > _ENTRIES_SIZE:
                _ENTRIES.pop(next(iter(_ENTRIES)))
    return copy.deepcopy(entry)


def _entry_json(entry: dict) -> str:
    return json.dumps({k: entry.get(k) for k in ("question", "answer", "metadata")}, sort_keys=True)


def last_answer_span(text: str) -> tuple[int, int] | None:
    """Where the last match of the library's ``<answer>\\s?(.*?)\\s?</answer>`` lies, found in linear time.

    ``utils.extract_answer`` runs that pattern over the whole reply, which takes quadratic time on a reply of
    many ``<answer>`` tags without a closing one; the matches are found here as its regex finds them (each from
    the next opening tag to the first closing tag after it), and the library reads the last one itself."""
    opened, closed = "<answer>", "</answer>"
    span, pos = None, 0
    while (start := text.find(opened, pos)) >= 0:
        end = text.find(closed, start + len(opened))
        if end < 0:
            break
        span = (start, end + len(closed))
        pos = span[1]
    return span


def read_answer(text: str, answer_format: str = "tags") -> str | None:
    """The answer in a reply, read as ``answer_format`` says (None: the reply holds none).

    ``tags``: the library's ``extract_answer`` on the last ``<answer>...</answer>``. ``line``: what follows the
    last ``Answer:`` line's colon (markdown emphasis and a closing full stop dropped). ``lenient``: that line,
    else the last number anywhere in the reply (thousands separators dropped)."""
    if answer_format == "tags":
        span = last_answer_span(text)
        return _library()[1].extract_answer(text[span[0]:span[1]]) if span else None
    found = None
    for m in _LINE.finditer(text):
        found = m.group(1)
    if found is not None:
        found = found.strip().strip("*_`").strip()
        if found.endswith(".") and not found.endswith(".."):
            found = found[:-1].rstrip()
        if found:
            return found
    if answer_format == "lenient":
        numbers = _NUMBER.findall(text)
        if numbers:
            return numbers[-1].replace(",", "").rstrip(".")
    return None


class ReasoningGymEnv:
    """One episode: a task of the library's, answered in up to ``attempts`` turns, scored by the library."""

    name = NAME
    config = ReasoningGymConfig
    requires = {"reasoning_gym": "reasoning-gym>=0.1.23"}
    extra = "reasoning_gym"
    runs_code = False
    max_concurrent = 0
    concurrent = False  # scoring is CPU work: threads would not help
    returns = "last"  # the score of the final attempt
    failure_return = 0.0

    def __init__(self, *, max_turns: int = 8, dataset: str = "leg_counting", config: dict | None = None,
                 weights: dict | None = None, attempts: int = 1, system_prompt: str = "default",
                 answer_format: str = "tags"):
        self.section = ReasoningGymConfig(dataset, dict(config or {}), dict(weights or {}), attempts, system_prompt,
                                          answer_format)
        self.section.validate()
        self.max_turns = max_turns
        if answer_format != "tags":
            self.system = LINE_PROMPT if system_prompt == "default" else system_prompt
        else:
            self.system = _library()[1].SYSTEM_PROMPTS.get(system_prompt, system_prompt)
        self.task = None

    @classmethod
    def tasks(cls, split: str, n: int, seed: int, *, dataset: str = "leg_counting", config: dict | None = None,
              weights: dict | None = None) -> list[dict]:
        """``n`` entries of the library's generator, each with the source that rebuilds it (dataset, settings,
        library seed and size, index); the library seed is ``_library_seed(split, seed)``."""
        if not 0 <= n <= STRIDE:
            raise ValueError(f"reasoning_gym: n must be in 0..{STRIDE}, got {n}")
        config, weights = dict(config or {}), dict(weights or {})
        ReasoningGymConfig(dataset, config, weights).validate()
        src = _source(dataset, config, weights, _library_seed(split, seed), max(n, 1))
        out = []
        for i in range(n):
            entry = _entry(src, i)
            try:
                task = json.loads(_entry_json(entry))
            except (TypeError, ValueError) as e:
                raise ValueError(f"reasoning_gym: {dataset} entry {i} is not JSON-serialisable: {e}") from None
            changed = task != {k: entry.get(k) for k in task}  # JSON made tuples lists, int keys strings
            source_dataset = (task.get("metadata") or {}).get("source_dataset", dataset)
            task.update(id=f"rg-{source_dataset}-s{src['seed']}-{i}", dataset=source_dataset,
                        source={**src, "index": i}, rebuild=changed)
            out.append(task)
        return out

    @staticmethod
    def task_key(task: dict) -> str:
        """Two tasks are the same question when their dataset, question and answer are (not their id or seed)."""
        return json.dumps([task.get("dataset"), task.get("question"), task.get("answer")], sort_keys=True, default=str)

    def reset(self, task: dict):
        """The task's entry as the library made it: as stored, or rebuilt from its source when JSON changed it
        (the metadata's tuples, which some scorers compare against, became lists); the task as stored when the
        rebuild differs from it (another library version, or a dataset whose entries depend on the process's
        string hashing)."""
        for k in ("question", "answer", "metadata", "source"):
            if k not in task:
                raise ValueError(f"reasoning_gym: task {task.get('id')!r} lacks {k!r}")
        src = {k: v for k, v in task["source"].items() if k != "index"}
        ds = _dataset(src)
        self.entry, self.rebuilt = {k: task[k] for k in ("question", "answer", "metadata")}, False
        if task.get("rebuild", True):
            rebuilt = _entry(src, int(task["source"]["index"]))
            if _entry_json(rebuilt) == _entry_json(task):
                self.entry, self.rebuilt = rebuilt, True
        self.scorer, self.task, self.turn = ds, task, 0
        messages = [{"role": "system", "content": self.system}, {"role": "user", "content": task["question"]}]
        return messages, {"id": task.get("id"), "dataset": task.get("dataset"), "rebuilt": self.rebuilt}

    def score(self, text: str) -> tuple[str | None, float, str | None]:
        """(the answer read as ``answer_format`` says, the library's score of it, the scorer's error if it raised).

        A scorer that raises on what the model wrote, or returns no finite number, scores 0 (a wrong answer;
        a NaN return would drop the episode from its member's mean as if the infrastructure had failed)."""
        answer = read_answer(clean_text(text), self.section.answer_format)
        try:
            value = float(self.scorer.score_answer(answer, self.entry))
        except Exception as e:  # noqa: BLE001 - the library's scorer on model text: a wrong answer
            return answer, 0.0, f"{type(e).__name__}: {str(e)[:_SHOWN]}"
        return answer, (value if math.isfinite(value) else 0.0), None

    def step(self, text: str):
        if self.task is None:
            raise RuntimeError("step() before reset()")
        self.turn += 1
        answer, reward, error = self.score(text)
        left = self.section.attempts - self.turn
        done = reward >= 1.0 or left <= 0
        info = {"answer": None if answer is None else answer[:_SHOWN], "score": reward, "attempt": self.turn,
                "correct": reward >= 1.0}
        if error:
            info["score_error"] = error
        if done:
            return [], reward, True, False, info
        tags = self.section.answer_format == "tags"
        said = (("No <answer>...</answer> found in your reply" if tags else "No final \"Answer: ...\" line found in "
                 "your reply") if answer is None
                else f"Your answer scored {reward:.2f} out of 1, so it is not correct")
        if self.turn >= self.max_turns:  # the run's turn budget ends it before the attempts do: no "try again"
            feedback = f"{said}. Out of turns ({self.turn}/{self.max_turns}): the episode is over."
            return [{"role": "user", "content": feedback}], reward, False, True, info
        left = min(left, self.max_turns - self.turn)  # the attempts the turn budget leaves
        form = "<answer>answer here</answer>" if tags else "a final line \"Answer: <your answer>\""
        feedback = (f"{said}. Try again ({left} attempt{'s' if left > 1 else ''} left): think it over and give only "
                    f"the final answer as {form}.")
        return [{"role": "user", "content": feedback}], reward, False, False, info
