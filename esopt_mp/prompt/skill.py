"""Skill synthesis (Trace2Skill-style): a SKILL.md, injected into every system prompt, edited from trajectories.

Each context update splits the step's trajectories (member order) into batches of ``batch``; a proposer reads one
batch's failed and successful episodes with the current SKILL.md and answers with edits (:mod:`.skill_edits`); the
batches' edits are merged, applied, and the candidate is kept only if its return on a held-out mini-batch, played
by the unperturbed model, is not lower than the current skill's on the same tasks and seeds. Everything left out
(malformed lines, conflicts, missing anchors, a rejected candidate) is recorded with its reason in
``run.dir/skill.jsonl`` and counted in the ledger's ``skill`` field. A candidate longer than ``max_chars`` (it joins
every system prompt) is rejected before validation: no evaluations are spent on it.

The proposer and the validation are injected callables ``proposer(prompt, step, batch) -> str`` (with an optional
``proposer.many(prompts, step)`` answering all batches at once) and ``validate(skill_text, step, steps) -> float``
(``steps``: every step whose trajectories the update read, so the held-out tasks exclude all tasks the proposer
saw): the trainer wires them through the agent objective (the policy itself or an OpenAI-compatible endpoint,
:mod:`.proposers`); tests pass scripted ones.
"""
from __future__ import annotations

import json
import logging
import math
import os
from typing import Callable

from esopt_mp.prompt.base import Trajectory, context_hash
from esopt_mp.prompt.skill_edits import apply_edits, merge, parse_edits, render_skill, parse_skill
from esopt_mp.runfiles import open_run_file, write_atomic

log = logging.getLogger(__name__)
SKILL_LOG = "skill.jsonl"
DEFAULT_SKILL = """# SKILL.md
Lessons for this task, distilled from earlier attempts. Follow them.

## Strategy

## Pitfalls
"""
PROPOSE = """You maintain SKILL.md, a short document of lessons that is shown to an agent before every task.
Below are the current SKILL.md and {n} episodes of the agent (their replies, the environment's feedback and the
return, higher is better; returns below {success:g} count as failures). Propose a few edits that would help the agent
avoid the failures and repeat the successes. Answer with one fenced block opened by ```edits holding one JSON object
per line, each one of:
{{"op": "insert", "section": "<section title>", "text": "<one line>"}}
{{"op": "insert", "section": "<section title>", "anchor": "<existing line>", "text": "<one line>"}}
{{"op": "replace", "section": "<section title>", "anchor": "<existing line>", "text": "<its new text>"}}
{{"op": "delete", "section": "<section title>", "anchor": "<existing line>"}}

Current SKILL.md:
<skill>
{skill}</skill>

{episodes}"""


def _clip(s: str, n: int) -> str:
    s = s.strip()
    return s if len(s) <= n else s[: n - 3] + "..."


class SkillSynthesis:
    name = "skill"

    def __init__(self, proposer: Callable[[str, int, int], str], validate: Callable[[str, int, tuple], float],
                 batch: int = 4, success: float = 0.5, initial: str = "", log_path: str | None = None,
                 episode_chars: int = 600, turns: int = 4, max_chars: int = 4000):
        if batch < 1:
            raise ValueError(f"prompt.skill.batch must be >= 1, got {batch}")
        self.proposer, self.validate = proposer, validate
        self.batch, self.success, self.episode_chars, self.turns = batch, success, episode_chars, turns
        pre, sections = parse_skill(initial or DEFAULT_SKILL)
        self.start = render_skill(pre, sections)  # canonical form: applying no edit leaves the text unchanged
        if len(self.start) > max_chars:
            raise ValueError(f"prompt.skill.max_chars: the initial SKILL.md has {len(self.start)} characters, more "
                             f"than the cap {max_chars}")
        self.max_chars = max_chars
        self.log_path = log_path
        self.last: dict = {}
        self.evaluations = 0  # validation evaluations over the run (restored from the ledger on resume)

    def initial(self) -> str:
        return self.start

    def render(self, context: str, seed: int, slot: int) -> str:
        return context

    def prompt(self, context: str, batch: list[Trajectory]) -> str:
        """The proposer's prompt for one batch: the skill, then failed episodes before successful ones."""
        failed = [t for t in batch if not (t.ret >= self.success)]  # NaN (a failed episode) counts as failure
        good = [t for t in batch if t.ret >= self.success]
        parts = []
        for title, group in (("Failed episodes", failed), ("Successful episodes", good)):
            if not group:
                continue
            parts.append(f"## {title}")
            for i, t in enumerate(group, 1):
                ret = "failed (no return)" if math.isnan(t.ret) else format(t.ret, ".4g")
                lines = [f"### Episode {i} (member {t.member}, return {ret})"]
                first = max(0, len(t.responses) - self.turns)  # the last turns: where an episode ends or fails
                if first:
                    lines.append(f"({first} earlier turns omitted)")
                for k, r in list(enumerate(t.responses))[first:]:
                    lines.append(f"Reply {k + 1}: {_clip(r, self.episode_chars)}")
                    if k < len(t.feedback) and t.feedback[k]:
                        lines.append(f"Feedback {k + 1}: {_clip(t.feedback[k], self.episode_chars)}")
                parts.append("\n".join(lines))
        return PROPOSE.format(n=len(batch), success=self.success, skill=context, episodes="\n\n".join(parts))

    def update(self, trajectories: list[Trajectory], context: str, step: int) -> str:
        batches = [trajectories[i:i + self.batch] for i in range(0, len(trajectories), self.batch)]
        prompts = [self.prompt(context, part) for part in batches]
        if not prompts:  # no trajectories this step (e.g. every episode on a TP peer's side was lost)
            answers = []
        elif hasattr(self.proposer, "many"):  # all batches at once (one generation batch, concurrent requests)
            answers = self.proposer.many(prompts, step)
        else:
            answers = [self.proposer(p, step, b) for b, p in enumerate(prompts)]
        proposals, malformed = [], []
        for b, answer in enumerate(answers):
            edits, bad = parse_edits(answer, b)
            proposals.append(edits)
            malformed += bad
        merged, left_out = merge(proposals)
        candidate, failed = apply_edits(context, merged)
        before = after = None
        seen = tuple(sorted({t.step for t in trajectories if t.step >= 0} | {step}))  # the tasks the proposer read
        if candidate == context:
            keep, why = False, "no change"
        elif len(candidate) > self.max_chars:
            keep, why = False, f"rejected: {len(candidate)} characters, over prompt.skill.max_chars={self.max_chars}"
        else:
            before, after = float(self.validate(context, step, seen)), float(self.validate(candidate, step, seen))
            self.evaluations += 2
            keep = not math.isnan(after) and (math.isnan(before) or after >= before)
            why = "kept: held-out return not lower" if keep else "rejected: held-out return lower"
        applied = len(merged) - len(failed)
        self.last = {"batches": len(batches), "proposed": sum(map(len, proposals)) + len(malformed),
                     "applied": applied if keep else 0, "malformed": len(malformed),
                     "conflicts": sum(not d["reason"].startswith("merged") for d in left_out),
                     "unapplicable": len(failed), "val_before": _num(before), "val_after": _num(after),
                     "kept": keep, "evaluations": 2 if before is not None else 0, "decision": why,
                     "chars": len(candidate)}
        log.info("step %d: skill %s (%d edits applied of %d proposed; held-out %s -> %s)", step, why,
                 self.last["applied"], self.last["proposed"], before, after)
        self._write({"step": step, "steps_read": list(seen), **self.last, "malformed_lines": malformed,
                     "left_out": left_out, "not_applied": failed, "edits": [e.to_json() for e in merged],
                     "candidate": context_hash(candidate), "candidate_text": candidate})
        return candidate if keep else context

    def ledger_fields(self) -> dict:
        return {"skill": dict(self.last)} if self.last else {}

    def restore(self, entries: list[dict]) -> None:
        """Evaluations so far from the ledger; ``skill.jsonl`` cut to the ledger's steps: a crash between its record
        and the ledger's would otherwise leave a record the resumed step writes again."""
        self.evaluations = sum(int((e.get("skill") or {}).get("evaluations", 0)) for e in entries)
        if not self.log_path or not os.path.exists(self.log_path):
            return
        steps = {e["step"] for e in entries}
        with open(self.log_path, encoding="utf-8") as f:
            lines = f.read().splitlines()
        keep = []
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:  # a torn last line
                continue
            if isinstance(rec, dict) and rec.get("step") in steps:
                keep.append(line)
        if len(keep) != len(lines):
            log.warning("%s: %d records of steps past the ledger removed", self.log_path, len(lines) - len(keep))
        write_atomic(self.log_path, "".join(ln + "\n" for ln in keep))

    def _write(self, rec: dict) -> None:
        if self.log_path:
            with open_run_file(self.log_path, "a") as f:
                f.write(json.dumps(rec, sort_keys=True) + "\n")


def _num(x):
    return None if x is None or math.isnan(x) else x


def build_skill(cfg, hooks: dict | None, run_dir: str | None, rank: int) -> SkillSynthesis:
    """The ``prompt.optimiser=skill`` optimiser from the ``prompt`` section and the run's proposer / validation."""
    hooks = hooks or {}
    if "proposer" not in hooks or "validate" not in hooks:
        raise ValueError("prompt.optimiser=skill needs a proposer and a validation (the agent objective wires them)")
    s = cfg.skill
    initial = ""
    if s.initial:
        with open(s.initial, encoding="utf-8") as f:
            initial = f.read()
    log_path = os.path.join(run_dir, SKILL_LOG) if run_dir and rank == 0 else None
    return SkillSynthesis(hooks["proposer"], hooks["validate"], s.batch, s.success, initial, log_path,
                          max_chars=s.max_chars)
