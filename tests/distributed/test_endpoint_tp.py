"""Same member, same text at tp=2: in a spawned gloo world of one tp pair, the TP leader serves the member (inside
``TPEngine.lead``, its peer following every forward) while a scripted client plays two 3-turn tool conversations
through the endpoint, one request at a time, alternating: the second opens after the first generated and joins
the batch the peer holds, so the first goes on in it. Each
equals, token for token, the one the in-process agent loop plays at tp=2, and the peer followed the same ids."""
import json
import os
import threading


from esopt_mp.parallel.local_world import run_world

AGENT = os.path.join(os.path.dirname(__file__), "..", "..", "esopt_mp", "assets", "tiny_agent")


def _worker(rank, world, out):
    from transformers import AutoTokenizer

    from esopt_mp.agent.loop import AgentConfig, run_episodes
    from esopt_mp.endpoint import EndpointConfig, EndpointServer
    from esopt_mp.engine.hf import HFEngine
    from esopt_mp.engine.base import SamplingParams
    from esopt_mp.engine.tp import TPEngine
    from esopt_mp.models import load_model
    from esopt_mp.parallel import discover, init_distributed
    from tools.bench_endpoint import ScriptedToolEnv, question, session_steps

    dims = init_distributed(discover(), 1, 2, timeout_s=120)
    tok = AutoTokenizer.from_pretrained(AGENT)
    engine = TPEngine(HFEngine(load_model(AGENT, dims), tok), dims)
    sampling = SamplingParams(temperature=0, presence_penalty=0.0, max_new_tokens=10)
    tasks = [{"id": str(k), "question": question(k)} for k in range(2)]
    seeds = [101, 202]
    got = {"rank": rank}
    server = EndpointServer(EndpointConfig(batch_window_s=0.2), tok).start() if engine.is_leader else None

    def serve():
        with server.member("member-0-0", seeds, sampling) as m:
            def client():  # one request at a time, alternating: episode 1 opens after episode 0 generated
                a, b = (session_steps(m.routes[k].base_url, "member-0-0", tasks[k], 3) for k in range(2))
                for _ in range(3):
                    next(a), next(b)

            th = threading.Thread(target=client)
            th.start()
            m.serve(engine, live=lambda: int(th.is_alive()), until=lambda: not th.is_alive())
            th.join()
            return [[list(t.conv.ids) for t in r.sessions.threads] for r in m.routes]

    served = engine.lead(serve, sampling)
    got["served"] = served if served is not None else engine.followed
    cfg = AgentConfig(max_turns=3, sampling=sampling)

    def loop():
        return [run_episodes(engine, [ScriptedToolEnv(3)], [t], [s], cfg)[0].token_ids for t, s in zip(tasks, seeds)]

    played = engine.lead(loop, sampling)
    got["loop"] = played if played is not None else engine.followed
    if server is not None:
        server.close()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(got, f)


def test_the_tp_leader_serves_and_its_peer_follows_the_agent_loops_tokens(tmp_path):
    run_world(2, _worker, str(tmp_path / "out"), timeout=300)
    lead, peer = (json.load(open(tmp_path / f"out.{r}")) for r in range(2))
    assert [len(r) for r in lead["served"]] == [1, 1]  # one conversation per episode, continued each turn
    served = [r[0] for r in lead["served"]]
    assert served == lead["loop"]  # through the endpoint = the in-process loop, at tp=2
    assert peer["served"] == served and peer["loop"] == lead["loop"]  # the peer followed every forward
