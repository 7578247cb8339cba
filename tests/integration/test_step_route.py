"""The route of one ES step: the files of esopt_mp whose code runs in ``ESTrainer.step`` on the embedded default,
traced, are the ones docs/design.md lists ("One ES step, file by file"), in a table a newcomer can follow."""
import os
import re
import sys
import threading

import esopt_mp

PKG = os.path.dirname(esopt_mp.__file__)
DESIGN = os.path.join(os.path.dirname(PKG), "docs", "design.md")


def documented_route() -> list[str]:
    text = open(DESIGN, encoding="utf-8").read()
    section = text.split("## One ES step, file by file", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| \d+ \| `([\w/]+\.py)` \|", section, flags=re.M)


def test_the_documented_route_is_the_traced_route_of_one_step(tmp_path):
    from tests.fixtures.inprocess import build_trainer

    trainer = build_trainer(tmp_path / "run", "es.population=2", "env.episodes_per_step=2", "es.steps=2",
                            "run.checkpoint_every=0")
    seen: list[str] = []

    def profile(frame, event, arg):
        f = frame.f_code.co_filename
        if event == "call" and f.startswith(PKG + os.sep):
            rel = os.path.relpath(f, PKG).replace(os.sep, "/")
            if rel not in seen:
                seen.append(rel)

    sys.setprofile(profile)
    threading.setprofile(profile)  # the environments' steps run on worker threads
    try:
        trainer.step(trainer.start_step)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        trainer.close()
    doc = documented_route()
    assert len(doc) == len(set(doc)) and doc, "the table lists each file once"
    assert set(seen) == set(doc), {"traced, not documented": sorted(set(seen) - set(doc)),
                                   "documented, not traced": sorted(set(doc) - set(seen))}
    assert seen[0] == doc[0] == "trainer.py"
