"""A harness's members served at once (es.member_batch): each member keeps its own slot of the engine's members in
every attempt, including a retry that holds only some of them (an episode the infrastructure failed is played once
more: with that member's terms, never another's)."""
import contextlib
import threading

import tests.unit.agent.test_harness as th
from esopt_mp.agent.harness import HarnessObjective, HarnessPlayer
from esopt_mp.core.types import Member
from esopt_mp.envs import InfraError

FAILED: set = set()


def flaky(base_url, model, task):
    """Member 1's episodes fail for the infrastructure once each; a reply names the member slot that wrote it."""
    r = th.ROUTES[base_url]
    if model == "member-0-1" and (model, task["id"]) not in FAILED:
        FAILED.add((model, task["id"]))
        raise InfraError("the site is down once")
    return float(r.chat("hi").split()[1])  # "slot S ..."


class SlotEngine:
    def new_conversation(self, cid, seed, member=-1):
        return member

    def generate(self, convs, new_ids, sampling, max_new=None):
        raise AssertionError("the fake server answers by itself")


class SlotServer:
    """Opens every member of a group as a fake member whose replies name the slot it was given."""

    def __init__(self):
        self.opened = []  # (model id, slot) per member opened

    @contextlib.contextmanager
    def members(self, specs, sampling):
        group = []
        for model, seeds, slot in specs:
            m = th.FakeMember(model, seeds, sampling, len(seeds))
            m.slot = slot
            group.append(m)
            self.opened.append((model, slot))
        stop = threading.Event()

        def answer(m):  # each member's own queue, answered as its slot
            while not stop.is_set():
                try:
                    route, _, box = m.pending.get(timeout=0.005)
                except Exception:  # noqa: BLE001 - queue.Empty
                    continue
                route.calls += 1
                route.records.append({"reply": f"slot {m.slot}"})
                box.put(f"slot {m.slot}")
        threads = [threading.Thread(target=answer, args=(m,), daemon=True) for m in group[1:]]
        for t in threads:
            t.start()
        group[0].serve = lambda engine, live, until: answer_until(group[0], until)

        def answer_until(m, until):
            t = threading.Thread(target=answer, args=(m,), daemon=True)
            t.start()
            while not until():
                stop.wait(0.005)
        try:
            yield group
        finally:
            stop.set()
            for m in group:
                with m.lock:
                    m.closed = True


def test_a_retry_serves_each_member_at_its_own_slot(tmp_path):
    cfg = th.harness_cfg(tmp_path, fn="flaky")
    th.flaky = flaky  # the harness is looked up by name in test_harness's module
    server = SlotServer()
    p = HarnessPlayer(cfg.objective, cfg.env, cfg.engine, cfg.run.seed, SlotEngine(), th.DIMS, server, "", None)
    members = [Member(0, 0, 11, 1), Member(0, 1, 12, -1), Member(0, 2, 13, 1)]
    returns = HarnessObjective(p).evaluate_members(members, batched=True)
    assert server.opened[:3] == [("member-0-0", 0), ("member-0-1", 1), ("member-0-2", 2)]
    assert server.opened[3:] == [("member-0-1", 1)]  # the retry holds member 1 alone, at its own slot
    assert returns == {0: 0.0, 1: 1.0, 2: 2.0}  # each member's episodes were answered by its own slot
