"""Where environments come from: the built-ins, lazily, and installed plugins, by entry point.

``env.name=NAME`` names one; its own settings are the section ``env.NAME.*``. Nothing is imported until a name
is asked for: the built-ins are a table of ``"module:Object"`` strings, plugins are the entry points of group
``esopt_mp.envs`` (``[project.entry-points."esopt_mp.envs"] NAME = "pkg.module:Factory"`` in a package's
pyproject). The runtime (objective, trainer, config) only ever talks to an :class:`EnvSpec`, so no environment's
name or knowledge lives outside its own module.

A plugin's object (usually the environment class) is wrapped by :class:`FactorySpec`, which reads what the
runtime needs from it, every attribute optional but ``tasks``:

- ``config``: a dataclass for the section (else one is built from the factory's keyword parameters);
- ``tasks(split, n, seed, **section)``: the task source (``split`` is ``"train"`` or ``"eval"``);
- ``task_key(task)``: what makes two tasks the same (default: the whole task), so that a held-out task equal to a
  training task is dropped;
- ``runs_code`` (the sandbox is checked at start-up), ``max_concurrent`` (episodes at once, 0: all),
  ``requires`` (import name -> pip requirement) and ``extra`` (the esopt_mp extra installing them), ``check``
  (a start-up check, given the section's keys), ``hashed_when_set`` (section key -> default: a key added after
  runs existed, left out of the config hash at its default so those runs keep their hash and their resume).

The episode's return (``returns = "last" | "sum"``), threads (``concurrent``) and ``failure_return`` are read
from each environment instance by the agent loop (:mod:`esopt_mp.envs.base`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import json
import threading
import logging
import typing
from importlib import metadata
from typing import Any

from esopt_mp.envs.spec import EnvSpec

log = logging.getLogger(__name__)
GROUP = "esopt_mp.envs"  # the entry-point group plugins declare
DEFAULT_ENV = "sudoku"  # the embedded default's

BUILTIN = {  # name -> "module:object"; imported when named
    "sudoku": "esopt_mp.envs.sudoku:SPEC",
    "math_react": "esopt_mp.envs.math_react:SPEC",
    "heuristic": "esopt_mp.envs.heuristic:SPEC",
    "docvqa": "esopt_mp.envs.docvqa:SPEC",
    "webarena_lite": "esopt_mp.envs.web.env:SPEC",
    "reasoning_gym": "esopt_mp.envs.libs.reasoning_gym:ReasoningGymEnv",
    "textarena": "esopt_mp.envs.libs.textarena:TextArenaEnv",
    "gem": "esopt_mp.envs.libs.gem:GemEnv",
    "gymnasium": "esopt_mp.envs.libs.gymnasium:GymnasiumEnv",
    "openenv": "esopt_mp.envs.libs.openenv:OpenEnvEnv",
}

# keys of the ``env`` section that moved into an environment's own section: old key -> new dotted key
MOVED = {"size": "sudoku.size", "mask_count": "sudoku.mask_count", "show_original": "sudoku.show_original",
         "hints": "sudoku.hints", "problem": "heuristic.problem", "web": "webarena_lite"}


class EnvNotFound(ValueError):
    """``env.name`` names no built-in and no installed plugin, or its module fails to import."""


def moved(key: str) -> str | None:
    """``env.<new>`` for an ``env.<key>`` that moved into an environment's section, else None."""
    new = MOVED.get(key)
    return f"env.{new}" if new else None


def _declared() -> dict[str, list[metadata.EntryPoint]]:
    """Each plugin name's entry points, one per installed distribution declaring it, in ``sys.path`` order."""
    out: dict[str, list[metadata.EntryPoint]] = {}
    for ep in metadata.entry_points(group=GROUP):
        out.setdefault(ep.name, []).append(ep)
    return out


def _plugins() -> dict[str, metadata.EntryPoint]:
    """The entry point used for each plugin name: the first on ``sys.path``, as ``import`` would find a module."""
    return {name: eps[0] for name, eps in _declared().items()}


def _dist(ep: metadata.EntryPoint) -> str:
    return getattr(ep.dist, "name", None) or "?"


def _origin(ep: metadata.EntryPoint) -> str:
    return f"plugin {ep.value} (distribution {_dist(ep)})"


def names() -> tuple[list[str], list[str]]:
    """(built-in names, installed plugin names), sorted; nothing is imported. A plugin named like a built-in is
    not among them: the built-in wins (:func:`shadowed`)."""
    plugins = [n for n in _plugins() if n not in BUILTIN]
    return sorted(BUILTIN), sorted(plugins)


def shadowed() -> dict[str, str]:
    """Installed plugins named like a built-in (name -> the plugin's target): never loaded."""
    return {n: ep.value for n, ep in _plugins().items() if n in BUILTIN}


def duplicates() -> dict[str, list[dict]]:
    """Plugin names more than one installed distribution declares: name -> each one's ``distribution`` and
    ``target``, the one used (the first on ``sys.path``) first. Which one a run gets must not be a silent accident
    of install order, so :func:`load_spec` warns."""
    return {name: [{"distribution": _dist(ep), "target": ep.value} for ep in eps]
            for name, eps in sorted(_declared().items()) if len(eps) > 1}


def _conflict(name: str) -> str | None:
    """One line on what else declares ``name`` (a built-in's, or another distribution's), or None."""
    eps = _declared().get(name, [])
    if name in BUILTIN and eps:
        return (f"environment {name!r}: the built-in is used; installed "
                f"{', '.join(_origin(ep) for ep in eps)} declare{'s' if len(eps) == 1 else ''} the same name and "
                f"cannot be used: rename its entry point")
    if len(eps) > 1:
        return (f"environment {name!r} is declared by {len(eps)} installed distributions, "
                f"{', '.join(f'{_dist(ep)} ({ep.value})' for ep in eps)}: using {_dist(eps[0])}'s, the first on "
                f"sys.path; to use another, uninstall {_dist(eps[0])} or give an entry point another name")
    return None


_SPECS: dict[str, "EnvSpec"] = {}
_LOCK = threading.Lock()


def load_spec(name: str) -> "EnvSpec":
    """The :class:`EnvSpec` of ``name`` (imported once); :class:`EnvNotFound` names what is known or what failed."""
    with _LOCK:
        if name in _SPECS:
            return _SPECS[name]
        target, plugin = BUILTIN.get(name), None
        where = f"built-in {target}"
        conflict = _conflict(name)
        if conflict:
            log.warning("%s", conflict)
        if target is None:
            ep = _plugins().get(name)
            if ep is None:
                builtin, plugins = names()
                from esopt_mp.typed import did_you_mean

                raise EnvNotFound(f"unknown environment {name!r}{did_you_mean(name, [*builtin, *plugins])}; built-in: "
                                  f"{', '.join(builtin)}; installed plugins: "
                                  f"{', '.join(plugins) or 'none'} (a plugin declares an entry point in group "
                                  f"{GROUP!r})")
            target = ep.value
            where = plugin = _origin(ep)
        module, _, attr = target.partition(":")
        try:
            obj = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except Exception as e:  # noqa: BLE001 - any import error of a plugin is reported with its name
            raise EnvNotFound(f"environment {name!r}: {where} failed to import: {type(e).__name__}: {e}") from e
        try:
            spec = obj if isinstance(obj, EnvSpec) else FactorySpec(name, obj, plugin=plugin)
        except EnvNotFound:
            raise
        except Exception as e:  # noqa: BLE001 - reading the factory ran its code (annotations, properties)
            raise EnvNotFound(f"environment {name!r}: {where} cannot be read: {type(e).__name__}: {e}") from e
        spec.name = name
        _SPECS[name] = spec
        return spec


def _unmet(module: str, requirement: str) -> str | None:
    """Why ``requirement`` (a pip requirement providing import ``module``) is not met here, or None."""
    if importlib.util.find_spec(module) is None:
        return f"{requirement} (not installed)"
    try:
        from packaging.requirements import Requirement

        req = Requirement(requirement)
        have = metadata.version(req.name)
    except Exception:  # noqa: BLE001 - no packaging, no metadata (a vendored copy): presence is all we can tell
        return None
    if req.specifier and not req.specifier.contains(have, prereleases=True):
        return f"{requirement} (installed: {have})"
    return None


def missing_requirements(spec: "EnvSpec") -> str | None:
    """One line naming the ``pip install`` that would provide ``spec``'s missing or too old packages, or None."""
    missing = [why for mod, req in (spec.requires or {}).items() if (why := _unmet(mod, req))]
    if not missing:
        return None
    how = (f"pip install 'esopt_mp[{spec.extra}]' (from a source checkout: pip install -e '.[{spec.extra}]')"
           if spec.extra else "pip install " + " ".join(f"'{r}'" for r in spec.requires.values()))
    return f"environment {spec.name!r} needs {', '.join(missing)}: {how}"


def build_section(spec: "EnvSpec", data: dict | None, key: str):
    """``spec.config`` built from ``data`` (unknown keys and mistyped values raise, naming ``key.<field>``). A
    mapping given for a field whose default is a non-empty mapping is merged into it (``key.weights.x=5`` adds
    ``x``), as the composed config does for the sections it holds defaults of."""
    from esopt_mp.typed import from_dict

    if data is not None and not isinstance(data, dict):
        raise ValueError(f"{key}: expected a mapping of its keys, got {data!r}")
    data = dict(data or {})
    defaults = spec.config()
    for f in dataclasses.fields(defaults):
        base = getattr(defaults, f.name)
        if isinstance(base, dict) and base and isinstance(data.get(f.name), dict):
            data[f.name] = {**base, **data[f.name]}
    return from_dict(spec.config, data, key)


_RUNTIME = ("max_turns", "sandbox")  # the runtime's keyword arguments of a factory, not section keys


def _section_type(name: str, factory) -> type:
    """A dataclass of the factory's keyword parameters that have defaults (the section), typed by annotation."""
    try:
        sig = inspect.signature(factory)
        hints = typing.get_type_hints(factory.__init__ if inspect.isclass(factory) else factory)
    except (TypeError, ValueError, NameError):
        sig, hints = inspect.signature(factory), {}
    fields = []
    for p in sig.parameters.values():
        if p.name in _RUNTIME or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is p.empty:
            continue
        tp = hints.get(p.name, type(p.default) if p.default is not None else Any)
        default = p.default
        if isinstance(default, (list, dict, set)):
            fields.append((p.name, tp, dataclasses.field(default_factory=lambda d=default: type(d)(d))))
        else:
            fields.append((p.name, tp, dataclasses.field(default=default)))
    return dataclasses.make_dataclass(f"{name.title().replace('_', '')}Section", fields)


class FactorySpec(EnvSpec):
    """A plugin's (or a library adapter's) factory object seen as an :class:`EnvSpec`.

    ``plugin``: where a plugin's factory comes from (its entry point and distribution; None for a built-in
    adapter): an exception its code raises at start-up is said in one line naming it, not as a traceback."""

    def __init__(self, name: str, factory, plugin: str | None = None):
        if not callable(factory):
            raise EnvNotFound(f"environment {name!r}: {factory!r} is not callable (an entry point names a class "
                              "or function building one episode's environment)")
        if not callable(getattr(factory, "tasks", None)):
            raise EnvNotFound(f"environment {name!r}: {getattr(factory, '__qualname__', factory)!r} has no "
                              "tasks(split, n, seed) (its task source)")
        self.name, self.factory, self.plugin = name, factory, plugin
        cfg = getattr(factory, "config", None)
        self.config = cfg if dataclasses.is_dataclass(cfg) else _section_type(name, factory)
        self.runs_code = bool(getattr(factory, "runs_code", False))
        self.requires = dict(getattr(factory, "requires", None) or {})
        self.extra = getattr(factory, "extra", None)
        self._params = _accepts(factory)
        how = getattr(factory, "returns", "last")
        if isinstance(how, str) and how not in ("last", "sum"):  # a property is the instance's business
            raise EnvNotFound(f"environment {name!r}: returns must be 'last' or 'sum', got {how!r}")
        required = _required(factory)
        if required:
            raise EnvNotFound(f"environment {name!r}: {getattr(factory, '__qualname__', factory)} takes "
                              f"{', '.join(required)} without a default: every section key needs one (it is what "
                              f"env.{name}.<key> overrides)")

    def _kwargs(self, section) -> dict:
        return {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}

    def build(self, section, *, max_turns: int, sandbox=None):
        return self.make(sandbox=sandbox, max_turns=max_turns, **self._kwargs(section))

    def make(self, sandbox=None, **kwargs):
        params = self._params
        if params is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in params or k not in _RUNTIME}
            if sandbox is not None and "sandbox" in params:
                kwargs["sandbox"] = sandbox
        elif sandbox is not None:
            kwargs["sandbox"] = sandbox
        return self.factory(**kwargs)

    def tasks(self, section, split: str, n: int, seed: int) -> list[dict]:
        fn = self.factory.tasks
        kwargs = self._kwargs(section)
        params = _accepts(fn)
        if params is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        with self._said(f"tasks({split!r}, {n}, {seed})"):
            tasks = list(fn(split, n, seed, **kwargs))
        bad = next((t for t in tasks if not isinstance(t, dict)), None)
        if bad is not None:
            raise ValueError(f"environment {self.name!r}: tasks() must return dicts, got {type(bad).__name__}")
        try:  # trajectories and resumes record tasks as JSON
            json.dumps(tasks, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"environment {self.name!r}: tasks({split!r}, ...) are not JSON: {e}") from None
        return tasks

    def identity(self, section) -> dict:
        """The section as hashed; a field the factory lists in ``hashed_when_set`` (name -> default) is left out
        at its default, so runs from before the field keep their hash."""
        d = super().identity(section)
        own = d.get(self.name, {})
        for k, default in (getattr(self.factory, "hashed_when_set", None) or {}).items():
            if k in own and own[k] == default:
                own.pop(k)
        return d

    def task_key(self, task: dict) -> str:
        fn = getattr(self.factory, "task_key", None)  # the factory's own notion of the same task, if it has one
        if not callable(fn):
            return super().task_key(task)
        with self._said("task_key()"):
            return str(fn(task))

    @contextlib.contextmanager
    def _said(self, call: str, passes: tuple = ()):
        """A plugin's ``call`` raising (but ``passes``, its own way to refuse): a ValueError, the one line a start-up
        reports, naming the plugin and the error. A built-in adapter's errors are its own, already one line."""
        try:
            yield
        except passes:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the plugin's code raised
            if self.plugin is None:
                raise
            why = " ".join(str(e).split())
            raise ValueError(f"environment {self.name!r}: {call} of {self.plugin} raised {type(e).__name__}"
                             + (f": {why}" if why else "")) from e

    def validate(self, section, env_cfg, key: str) -> None:
        why = missing_requirements(self)
        if why:
            raise ValueError(f"{key}: {why}")
        with self._said(f"{key}'s validate()", passes=(ValueError,)):  # a ValueError names the key it refuses
            super().validate(section, env_cfg, key)

    def check(self, section, env_cfg, first: bool) -> None:
        super().check(section, env_cfg, first)
        fn = getattr(self.factory, "check", None)
        if callable(fn):
            kwargs = self._kwargs(section)
            params = _accepts(fn)
            fn(**({k: v for k, v in kwargs.items() if k in params} if params is not None else kwargs))

    def max_concurrent(self, section) -> int:
        value = getattr(section, "max_concurrent", None)
        return int(value if value is not None else getattr(self.factory, "max_concurrent", 0) or 0)


def _required(factory) -> list[str]:
    """The factory's parameters without a default, but the runtime's (``max_turns``, ``sandbox``)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is p.empty and p.name not in _RUNTIME
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _accepts(fn) -> set[str] | None:
    """The keyword names ``fn`` takes; None when it takes ``**kwargs`` (anything)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def describe(name: str) -> dict:
    """What ``python -m esopt_mp.envs show NAME`` prints: where it comes from (and what else declares its name),
    its section and its defaults."""
    spec = load_spec(name)
    section = spec.config()
    eps = _declared().get(name, [])
    used = None if name in BUILTIN or not eps else eps[0]
    return {"name": name, "source": used.value if used else BUILTIN[name],
            "distribution": _dist(used) if used else None,
            "not_used": [f"{_dist(ep)}: {ep.value}" for ep in (eps[1:] if used else eps)],
            "section": {f.name: getattr(section, f.name) for f in dataclasses.fields(section)},
            "types": {f.name: f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
                      for f in dataclasses.fields(section)},
            "runs_code": spec.runs_code, "requires": spec.requires, "missing": missing_requirements(spec)}
