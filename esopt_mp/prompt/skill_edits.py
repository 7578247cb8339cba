"""SKILL.md as named sections, the strict edit format proposers write, and the merge of parallel batches' edits.

A SKILL.md is a preamble followed by ``## Section`` headings, each with body lines. A proposal carries its edits as
JSON lines inside one fenced block, read line by line: it opens at a line starting with ```` ```edits ```` and closes
at the first line that is only ```` ``` ```` (so a ```` ``` ```` inside a JSON string does not cut it; an unclosed
block is read to the end, and that is recorded among the drops). Anything outside the block is ignored; one object
per line::

    {"op": "insert",  "section": "Pitfalls", "text": "- check the bin capacity first", "anchor": "<optional line>"}
    {"op": "replace", "section": "Strategy", "anchor": "<an existing line>", "text": "<its new text>"}
    {"op": "delete",  "section": "Strategy", "anchor": "<an existing line>"}

``anchor`` is an existing body line of the section, compared after stripping spaces; an insert goes after it, or at
the end of the section without one (an insert into a missing section creates it). Texts are single lines. A line
that breaks the format is dropped with its reason; the rest of the proposal stands.
"""
from __future__ import annotations

import dataclasses
import json
import re

OPS = ("insert", "replace", "delete")
_THINK = re.compile(r"<think>.*?</think>", re.S)  # a closed reasoning block (it may hold a draft)
MAX_TEXT = 400  # characters of one inserted / replacing line


@dataclasses.dataclass(frozen=True)
class Edit:
    op: str
    section: str
    anchor: str = ""
    text: str = ""
    batch: int = 0  # which parallel batch proposed it (the merge's tie-break: lower first)
    index: int = 0  # its position in that batch's proposal

    def key(self) -> tuple:
        return (self.op, self.section, self.anchor, self.text)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _norm(line: str) -> str:
    return " ".join(line.split())


def parse_skill(text: str) -> tuple[list[str], dict[str, list[str]]]:
    """(preamble lines, {section title: body lines without blank lines around}) in document order; repeated
    titles are joined."""
    pre: list[str] = []
    sections: dict[str, list[str]] = {}
    cur = None
    for line in text.splitlines():
        if line.startswith("## "):
            cur = line[3:].strip()
            sections.setdefault(cur, [])
        elif cur is None:
            pre.append(line)
        else:
            sections[cur].append(line)
    for body in sections.values():  # the blank lines around a body are layout, not content
        while body and not body[-1].strip():
            body.pop()
        while body and not body[0].strip():
            body.pop(0)
    return pre, sections


def render_skill(pre: list[str], sections: dict[str, list[str]]) -> str:
    """The document back as text: one blank line before each heading, no trailing blank lines in a body."""
    out = [ln for ln in pre]
    while out and not out[-1].strip():
        out.pop()
    for title, body in sections.items():
        lines = list(body)
        while lines and not lines[-1].strip():
            lines.pop()
        while lines and not lines[0].strip():
            lines.pop(0)
        out += ([""] if out else []) + [f"## {title}"] + lines
    return "\n".join(out) + "\n"


def parse_edits(text: str, batch: int = 0) -> tuple[list[Edit], list[dict]]:
    """The edits of one proposal and, for every line refused, ``{"batch", "line", "reason"}``."""
    body, closed = _block(text or "")
    if body is None:
        return [], [{"batch": batch, "line": 0, "reason": "no ```edits block in the proposal"}]
    edits, drops = [], []
    if not closed:  # e.g. the proposal ran out of tokens: its complete lines still count
        drops.append({"batch": batch, "line": len(body) + 1, "reason": "the ```edits block is not closed: read to the "
                                                                        "end of the proposal"})
    for n, raw in enumerate(body, 1):
        if not raw.strip():
            continue
        why = None
        try:
            obj = json.loads(raw)
        except ValueError as e:
            obj, why = None, f"not JSON: {e}"
        if obj is not None:
            why = _refuse(obj)
        if why:
            drops.append({"batch": batch, "line": n, "reason": why, "text": raw[:200]})
            continue
        edits.append(Edit(obj["op"], obj["section"].strip(), _norm(obj.get("anchor", "")), obj.get("text", "").strip(),
                          batch, len(edits)))
    return edits, drops


def _block(text: str) -> tuple[list[str] | None, bool]:
    """The lines of the first ```edits block after any reasoning (None: there is none) and whether a line that
    is only ``` closed it. A reasoning model's ``<think>...</think>`` (a closed one) may hold a draft block: the
    answer is what follows it (a line that is only ``</think>``, where the template opened the block itself)."""
    text = _THINK.sub("\n", text)
    lines = text.splitlines()
    end = next((i for i, ln in enumerate(lines) if ln.strip() == "</think>"), None)
    if end is not None:
        lines = lines[end + 1:]
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("```edits")), None)
    if start is None:
        return None, False
    for i in range(start + 1, len(lines)):
        if lines[i].strip() == "```":
            return lines[start + 1:i], True
    return lines[start + 1:], False


def _refuse(obj) -> str | None:
    """Why a parsed line is not an edit (None: it is one)."""
    if not isinstance(obj, dict):
        return "not a JSON object"
    extra = set(obj) - {"op", "section", "anchor", "text"}
    if extra:
        return f"unknown fields {sorted(extra)}"
    if obj.get("op") not in OPS:
        return f"op must be one of {OPS}, got {obj.get('op')!r}"
    for k in ("section", "anchor", "text"):
        if k in obj and not isinstance(obj[k], str):
            return f"{k} must be a string"
    for k in ("section", "anchor", "text"):
        v = obj.get(k, "")
        if len(v.strip().splitlines()) > 1:  # str.splitlines also splits on \r, \x0b, \x85, \u2028, ...
            return f"{k} must be a single line (no line or paragraph separator of any kind)"
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            return f"{k} is not valid UTF-8 text (a lone surrogate)"
    sec = obj.get("section", "").strip()
    if not sec or "\n" in sec or sec.startswith("#"):
        return "section must be a one-line title without '#'"
    op, anchor, text = obj["op"], obj.get("anchor", "").strip(), obj.get("text", "").strip()
    if op in ("replace", "delete") and not anchor:
        return f"{op} needs an anchor (the existing line)"
    if op in ("insert", "replace") and not text:
        return f"{op} needs a text"
    if op == "delete" and text:
        return "delete takes no text"
    if "\n" in text or "\n" in anchor:
        return "text and anchor are single lines"
    if text.startswith("## "):
        return "text may not open a section heading"
    if len(text) > MAX_TEXT:
        return f"text longer than {MAX_TEXT} characters"
    return None


def merge(proposals: list[list[Edit]]) -> tuple[list[Edit], list[dict]]:
    """One edit list from parallel batches' edits, and every edit left out with its reason.

    Rules (deterministic; batches in order, a batch's edits in order):
    - the same edit from several batches is applied once (the later copies are recorded as merged);
    - two different replaces of one (section, anchor): the lower batch's wins, the other is dropped;
    - a delete and a replace of one (section, anchor): the replace wins (it keeps the line's place), the delete
      is dropped; inserts anchored on a line another edit deletes are dropped (their place is gone).
    The result lists the inserts before the replaces and deletes (each group in batch order).
    """
    kept: list[Edit] = []
    out: list[dict] = []
    seen: dict[tuple, Edit] = {}
    target: dict[tuple, Edit] = {}  # (section, anchor) -> the replace or delete that owns the line
    for e in sorted((e for p in proposals for e in p), key=lambda e: (e.batch, e.index)):
        if e.key() in seen:
            out.append({**e.to_json(), "reason": f"merged: same edit as batch {seen[e.key()].batch}"})
            continue
        if e.op in ("replace", "delete"):
            other = target.get((e.section, e.anchor))
            if other is not None and not (other.op == "delete" and e.op == "replace"):
                out.append({**e.to_json(), "reason": f"conflict: {other.op} of the same line by batch {other.batch} "
                                                     f"wins"})
                continue
            if other is not None:  # a replace displaces an earlier delete of the same line
                kept.remove(other)
                out.append({**other.to_json(), "reason": f"conflict: replace of the same line by batch {e.batch} wins"})
            target[(e.section, e.anchor)] = e
        seen[e.key()] = e
        kept.append(e)
    final = []
    for e in kept:
        owner = target.get((e.section, e.anchor)) if e.op == "insert" and e.anchor else None
        if owner is not None and owner.op == "delete":
            out.append({**e.to_json(), "reason": f"conflict: its anchor is deleted by batch {owner.batch}"})
            continue
        final.append(e)
    # inserts first: an insert anchored on a line another batch replaces still finds its anchor
    return [e for e in final if e.op == "insert"] + [e for e in final if e.op != "insert"], out


def apply_edits(text: str, edits: list[Edit]) -> tuple[str, list[dict]]:
    """``text`` with ``edits`` applied in order, and the edits that did not apply (missing section or anchor, or a
    text the section already holds)."""
    pre, sections = parse_skill(text)
    failed = []
    for e in edits:
        body = sections.get(e.section)
        if body is None and e.op == "insert" and not e.anchor:
            sections[e.section] = body = []
        if body is None:
            failed.append({**e.to_json(), "reason": f"no section {e.section!r}"})
            continue
        at = next((i for i, ln in enumerate(body) if _norm(ln) == e.anchor), None) if e.anchor else None
        if e.anchor and at is None:
            failed.append({**e.to_json(), "reason": f"anchor not found in section {e.section!r}"})
            continue
        if e.op in ("insert", "replace") and any(_norm(ln) == _norm(e.text) for ln in body):
            failed.append({**e.to_json(), "reason": f"its text is already a line of section {e.section!r}"})
            continue
        if e.op == "insert":
            if at is None:
                while body and not body[-1].strip():
                    body.pop()
                body.append(e.text)
            else:
                body.insert(at + 1, e.text)
        elif e.op == "replace":
            body[at] = e.text
        else:
            del body[at]
    return render_skill(pre, sections), failed
