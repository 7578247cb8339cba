"""webarena_lite without a browser: reply parsing, observation trimming, config checks, task sets, preflight."""
import http.server
import json
import threading

import pytest

from esopt_mp.config import ConfigError, build_config
from esopt_mp.envs import make, registered
from esopt_mp.envs.web import stack
from esopt_mp.envs.web import tasks as wt
from esopt_mp.envs.web.actions import ActionError, parse_action
from esopt_mp.envs.web.observation import estimate_tokens, render, trim_tree
from esopt_mp.identity import config_hash


@pytest.mark.parametrize("reply,action", [
    ('I will click the button.\nclick("12")', "click('12')"),
    ("click(12)", "click('12')"),
    ('fill("3", "a) b, \\"c\\"")', "fill('3', 'a) b, \"c\"')"),
    ('select_option("4", ["x", "y"])', "select_option('4', ['x', 'y'])"),
    ('press("5", "Control+a")', "press('5', 'Control+a')"),
    ("scroll(0, 250.5)", "scroll(0, 250.5)"),
    ('goto("http://127.0.0.1/x")', "goto('http://127.0.0.1/x')"),
    ('goto("HTTPS://example.com")', "goto('HTTPS://example.com')"),
    ("go_back()", "go_back()"), ("go_forward()", "go_forward()"), ("new_tab()", "new_tab()"),
    ("tab_focus(1)", "tab_focus(1)"), ('hover("7")', "hover('7')"),
    ('click("1") then finally send_msg_to_user("42")', "send_msg_to_user('42')"),
    ('report_infeasible("no such page")', "report_infeasible('no such page')"),
    ('<think>click("9")</think>\ngo_back()', "go_back()"),
])
def test_replies_become_browsergym_actions(reply, action):
    assert parse_action(reply) == action


@pytest.mark.parametrize("reply,msg", [
    ("I don't know.", "no action found"),
    ('<think>click("9")</think> hmm', "no action found"),
    ('click(__import__("os").system("id"))', "literal strings or numbers"),
    ('click("1", button="right")', "by position"),
    ("fill(\"3\")", "fill takes 2 arguments, got 1"),
    ('tab_focus("1")', "must be an integer"),
    ("scroll(0)", "scroll takes 2 arguments"),
    ("scroll(0, 1e999)", "must be a finite number"),
    ("scroll(-1e400, 0)", "must be a finite number"),
    ('goto("file:///etc/passwd")', "must start with http:// or https://"),
    ('goto("javascript:alert(1)")', "must start with http:// or https://"),
    ('goto("chrome://settings")', "must start with http:// or https://"),
    ('goto("127.0.0.1/x")', "must start with http:// or https://"),
])
def test_unparseable_replies_say_why(reply, msg):
    with pytest.raises(ActionError, match=msg) as e:
        parse_action(reply)
    assert "click(" in str(e.value)  # the feedback lists the actions


def test_tree_trimming_keeps_the_focused_element_and_the_header():
    tree = "\n".join(f"[{i}] button 'b{i}'" for i in range(2000))
    out = trim_tree(tree, 100, "1500")
    assert "[1500] button" in out and "[0] button" not in out and estimate_tokens(out) <= 100
    assert "lines above cut" in out and "lines below cut" in out
    assert trim_tree(tree, 100).startswith("[0] button")  # no focus: from the top
    assert trim_tree("[1] a", 100) == "[1] a"
    obs = {"url": "http://x/", "last_action_error": "ValueError: no bid 99", "focused_element_bid": "1999",
           "chat_messages": [{"role": "user", "message": "goal"}, {"role": "assistant", "message": "said 7"}]}
    text = render(obs, tree, 200, "goal", feedback="parse feedback")
    assert all(s in text for s in ("# Goal\ngoal", "said 7", "parse feedback", "no bid 99", "[1999] button"))
    assert estimate_tokens(text) <= 200 + 40


def test_every_part_of_the_observation_is_capped_to_the_budget():
    """A 2,000-line error, a huge chat message and goal: the whole stays within obs_tokens, each cut with a marker."""
    err = "\n".join(f"line {i} of a long playwright call log" for i in range(2000))
    obs = {"url": "http://x/" + "q" * 20000, "last_action_error": err, "focused_element_bid": "1999",
           "chat_messages": [{"role": "assistant", "message": "m" * 50000}],
           "open_pages_urls": ["http://a/" + "z" * 5000] * 50, "active_page_index": [0]}
    tree = "\n".join(f"[{i}] button 'b{i}'" for i in range(2000))
    for budget in (3000, 400, 64):
        text = render(obs, tree, budget, "G" * 100000, feedback="f" * 9000)
        assert estimate_tokens(text) <= budget, (budget, estimate_tokens(text))
    text = render(obs, tree, 3000, "G" * 100000, feedback="f" * 9000)
    assert text.count("characters cut]") >= 5 and "line 0 of" in text and "line 1999 of" not in text
    assert "[1999] button" in text  # the tree still gets its share
    goal = "Find the cheapest red shoe and add it to the cart. " * 10
    assert f"# Goal\n{goal}\n" in render(obs, tree, 3000, goal)  # a goal within its share is kept whole


def test_the_focused_element_is_found_by_its_own_id_not_a_footnote():
    tree = "\n".join(["[3] paragraph 'see footnote [1500]'"] + [f"\t[{i}] button 'b{i}'" for i in range(4, 2000)])
    out = trim_tree(tree, 100, "1500")
    assert "\t[1500] button 'b1500'" in out and "footnote" not in out


def test_web_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"env.webarena_lite.split: must be one of"):
        build_config({"env": {"name": "webarena_lite", "webarena_lite": {"split": "dev"}}})
    with pytest.raises(ConfigError, match=r"env.webarena_lite.max_browsers: must be >= 1"):
        build_config({"env": {"name": "webarena_lite", "webarena_lite": {"max_browsers": 0}}})
    with pytest.raises(ConfigError, match=r"unknown config key 'env.webarena_lite.browsers'"):
        build_config({"env": {"name": "webarena_lite", "webarena_lite": {"browsers": 2}}})
    with pytest.raises(ConfigError, match=r"env.webarena_lite.step_timeout_s: 900.0 exceeds episode_timeout_s"):
        build_config({"env": {"name": "webarena_lite", "webarena_lite": {"step_timeout_s": 900}}})


def test_web_settings_in_the_hash_only_for_webarena_and_not_the_paths():
    base = {"env": {"name": "webarena_lite"}}
    h = config_hash(build_config(base))
    assert config_hash(build_config({"env": {"name": "webarena_lite", "webarena_lite": {"chromium": "/x", "max_browsers": 9}}})) == h
    assert config_hash(build_config({"env": {"name": "webarena_lite", "webarena_lite": {"obs_tokens": 999}}})) != h
    assert config_hash(build_config({"env": {"webarena_lite": {"obs_tokens": 999}}})) == config_hash(build_config({}))


def test_registered_without_importing_browsergym():
    assert "webarena_lite" in registered()
    env = make("webarena_lite", max_turns=3)
    assert env.max_turns == 3 and env.gym is None and env.close() == 0
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("go_back()")


CONFIGS = [
    {"old_task_id": 10, "sites": ["shopping"], "intent": "a", "eval": {"eval_types": ["string_match"],
                                                                       "reference_answers": {"must_include": ["1"]}}},
    {"old_task_id": 11, "sites": ["map"], "intent": "b", "eval": {"eval_types": ["string_match"],
                                                                  "reference_answers": {"fuzzy_match": ["x"]}}},
    {"old_task_id": 12, "sites": ["gitlab"], "intent": "c", "eval": {"eval_types": ["program_html"]}},
    {"old_task_id": 15, "sites": ["reddit"], "intent": "d", "eval": {"eval_types": ["url_match"]}},
]


def test_task_selection_splits_and_counts_exclusions():
    tasks, counts = wt.select(configs=CONFIGS, judge=False)
    assert [t["id"] for t in tasks] == ["webarenalite.10", "webarenalite.12", "webarenalite.15"]
    assert counts == {"selected": 4, "excluded_needs_judge": 1, "excluded_not_answer_only": 0, "kept": 3}
    assert [t["id"] for t in wt.select(configs=CONFIGS, judge=True)[0]][1] == "webarenalite.11"
    assert [t["id"] for t in wt.select(split="heldout", configs=CONFIGS, judge=True)[0]] == ["webarenalite.10",
                                                                                              "webarenalite.15"]
    assert wt.select(only_answer=True, configs=CONFIGS, judge=False)[1]["kept"] == 1
    with pytest.raises(ValueError, match=r"env.webarena_lite.task_ids: unknown WebArena-Lite task ids \[99\]"):
        wt.select([99], configs=CONFIGS)


class _Judge(http.server.BaseHTTPRequestHandler):
    models = ["gpt-4-1106-preview"]

    def do_GET(self):  # noqa: N802
        ok = self.path == "/v1/models" and self.headers.get("Authorization") == "Bearer k"
        body = json.dumps({"data": [{"id": m} for m in self.models]}).encode()
        self.send_response(200 if ok else 401)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def test_judge_preflight_checks_the_url_the_key_and_the_model_browsergym_asks_for(monkeypatch):
    handler = type("J", (_Judge,), {"models": list(_Judge.models)})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{srv.server_address[1]}/v1"
    try:
        monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
        monkeypatch.setenv("OPENAI_API_KEY", "k")
        assert not wt.judge_available()  # the names BrowserGym's judge client reads, and no others
        monkeypatch.setenv("OPENAI_BASE_URL", base)
        assert wt.judge_available() and wt.judge_preflight(5) == ["gpt-4-1106-preview"]
        monkeypatch.setenv("OPENAI_API_KEY", "wrong")
        with pytest.raises(RuntimeError, match="answers HTTP 401"):
            wt.judge_preflight(5)
        monkeypatch.setenv("OPENAI_API_KEY", "k")
        handler.models = ["qwen-judge"]
        with pytest.raises(RuntimeError, match="does not serve 'gpt-4-1106-preview'"):
            wt.judge_preflight(5)
    finally:
        srv.shutdown()
        srv.server_close()
    with pytest.raises(RuntimeError, match="judge .* is unreachable"):
        wt.judge_preflight(5)
    assert all("judged" in t for t in wt.select(configs=CONFIGS, judge=True)[0])
    with pytest.raises(ConfigError, match="unknown config key 'env.webarena_lite.judge_url_env'"):
        build_config({"env": {"name": "webarena_lite", "webarena_lite": {"judge_url_env": "X"}}})


def test_preflight_names_the_missing_variable_and_the_unreachable_site(monkeypatch):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    up = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        for s in wt.SITES:
            monkeypatch.delenv(wt.site_var(s), raising=False)
        with pytest.raises(RuntimeError, match="WA_SHOPPING is not set"):
            wt.preflight(["shopping"])
        for s in wt.SITES:
            monkeypatch.setenv(wt.site_var(s), up)
        assert wt.preflight(["shopping", "map"], 5) == {"map": 200, "shopping": 200}
        s = __import__("socket").socket()
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
        s.close()
        monkeypatch.setenv("WA_GITLAB", dead)
        with pytest.raises(RuntimeError, match=rf"site gitlab \(WA_GITLAB={dead}\) is unreachable"):
            wt.preflight(["shopping", "gitlab"], 5)
    finally:
        srv.shutdown()


def test_stack_check_is_one_line_naming_the_missing_part(monkeypatch, tmp_path):
    monkeypatch.setattr(stack, "PACKAGES", {"no_such_module_xyz": "browsergym-core==0.14.3"})
    with pytest.raises(stack.WebStackMissing) as e:
        stack.check()
    assert "\n" not in str(e.value) and "browsergym-core==0.14.3 is missing" in str(e.value)
    monkeypatch.setattr(stack, "PACKAGES", {})
    monkeypatch.setattr(stack, "DEBIAN_CHROMIUM", (str(tmp_path / "none"),) * 2)
    monkeypatch.setattr(stack.shutil, "which", lambda name: None)
    monkeypatch.delenv("ESOPT_CHROMIUM", raising=False)
    with pytest.raises(stack.WebStackMissing, match="no Chromium binary"):
        stack.check()
