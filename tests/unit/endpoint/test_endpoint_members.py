"""Several members served at once (es.member_batch): each under its own model id and routes, their requests answered
in one engine batch whose rows carry each member's slot, the plain routes choosing a member by the model named, and
every route refused once the members end."""
import concurrent.futures
import threading
import types

import pytest

from esopt_mp.endpoint.config import EndpointConfig
from esopt_mp.endpoint.server import EndpointServer
from tests.unit.endpoint.test_endpoint_server import AGENT, SAMPLING, FakeEngine, chat, httpx

SPECS = [("member-3-0", [11, 12], 0), ("member-3-5", [21, 22], 1)]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(AGENT)


class SlotEngine(FakeEngine):
    """Replies name the conversation's member slot; every batch's rows' slots are recorded."""

    def __init__(self, tok):
        super().__init__(tok)
        self.slots = []

    def new_conversation(self, cid, seed, member=-1):
        return types.SimpleNamespace(ids=[], seed=seed, member=member)

    def generate(self, convs, new_ids, params, max_new=None):
        self.slots.append([c.member for c in convs])
        out = super().generate(convs, new_ids, params, max_new)
        for c, g in zip(convs, out):
            g.text = f"slot {c.member} {g.text}"
        return out


def _serve(server, engine, live):
    stop = threading.Event()
    cm = server.members(SPECS, SAMPLING)
    group = cm.__enter__()
    th = threading.Thread(target=group[0].serve, args=(engine,), kwargs={"live": live, "until": stop.is_set},
                          daemon=True)
    th.start()

    def end():
        stop.set()
        th.join(10)
        cm.__exit__(None, None, None)
        assert not th.is_alive()
    return group, end


def test_members_at_once_share_one_batch_each_row_its_slot(tokenizer):
    eng = SlotEngine(tokenizer)
    with EndpointServer(EndpointConfig(batch_window_s=5.0), tokenizer) as server:
        group, end = _serve(server, eng, live=lambda: 4)
        try:
            routes = [(m.model_id, r.base_url) for m in group for r in m.routes]
            msgs = [{"role": "user", "content": "hello"}]
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                replies = list(pool.map(lambda mr: chat(mr[1], mr[0], msgs).json(), routes))
            # lockstep over both members' four episodes: one batch, rows in episode order, each its member's slot
            assert eng.slots == [[0, 0, 1, 1]]
            got = [(r["model"], r["choices"][0]["message"]["content"]) for r in replies]
            assert got == [("member-3-0", "slot 0 v0 seed 11 at 0"), ("member-3-0", "slot 0 v0 seed 12 at 0"),
                           ("member-3-5", "slot 1 v0 seed 21 at 0"), ("member-3-5", "slot 1 v0 seed 22 at 0")]
            # a route answers only as its own member
            wrong = chat(group[0].routes[0].base_url, "member-3-5", msgs)
            assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
            # the plain routes: both listed, the model named picks the member, none named is one line
            assert [d["id"] for d in httpx.get(f"{server.url}/v1/models").json()["data"]] == ["member-3-0",
                                                                                            "member-3-5"]
            plain = chat(f"{server.url}/v1", "member-3-5", msgs).json()
            assert plain["choices"][0]["message"]["content"].startswith("slot 1 ")
            assert [m.shared.index for m in group] == [4, 5]  # after every episode, one per member: a fixed order
            other = chat(f"{server.url}/v1", "member-9-9", msgs)
            assert other.status_code == 404 and "name one as the model" in other.json()["error"]["message"]
            with pytest.raises(RuntimeError, match="being served"):
                with server.member("member-4-0", [1], SAMPLING):
                    pass
        finally:
            end()
        for model, url in routes:  # ended: every route refused, none answered by other weights
            r = chat(url, model, [{"role": "user", "content": "late"}])
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        with pytest.raises(ValueError, match="distinct model ids"):
            with server.members([("a", [1], 0), ("a", [2], 1)], SAMPLING):
                pass
        with pytest.raises(ValueError, match="distinct member slots"):
            with server.members([("a", [1], 0), ("b", [2], -1)], SAMPLING):
                pass
