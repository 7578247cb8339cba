"""A demo site on 127.0.0.1 with BrowserGym tasks on it (``env.webarena_lite.suite=demo``): CPU runs and tests.

The site is served from a thread of the process that plays the episodes,
started at the first reset; nothing leaves the machine. Two task kinds, each
varied by the task's seed: ``form`` (type a name into a field and submit;
scored from the URL the form leads to) and ``code`` (read a number off the
page and answer it with ``send_msg_to_user``). Either scores 1 or 0. A task
dict with a ``url`` plays on that site instead (a test's own server).
"""
from __future__ import annotations

import http.server
import threading
import urllib.parse

NAMES = ("Ada", "Grace", "Alan", "Edsger", "Barbara", "Donald", "Frances", "John")
KINDS = ("form", "code")
PAGE = """<html><head><title>Demo</title></head><body>
<h1>Sign-up</h1><form action="/result" method="get">
<label for="name">Name</label><input id="name" name="name" type="text">
<button type="submit">Submit</button></form><p>Secret code: {code}</p></body></html>"""
LOGIN = """<html><head><title>Login</title></head><body><form onsubmit="return false;">
<label for="u">Username</label><input id="u" type="text"><label for="e">Email</label><input id="e" type="text">
<label for="p">Password</label><input id="p" type="password"><button type="submit">Sign In</button>
</form><p>stub site</p></body></html>"""


def code_of(seed: int) -> int:
    return 1000 + (seed * 7919) % 9000


class _Handler(http.server.BaseHTTPRequestHandler):
    login_only = False

    def do_GET(self):  # noqa: N802
        url = urllib.parse.urlparse(self.path)
        if self.login_only:
            body = LOGIN
        elif url.path == "/result":
            name = urllib.parse.parse_qs(url.query).get("name", [""])[0]
            body = f"<html><body><h1>Thanks, {name}</h1></body></html>"
        elif url.path == "/":
            seed = int(urllib.parse.parse_qs(url.query).get("seed", ["0"])[0])
            body = PAGE.format(code=code_of(seed))
        else:
            self.send_error(404)
            return
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


def serve(login_only: bool = False) -> tuple[http.server.ThreadingHTTPServer, str]:
    """A server on 127.0.0.1 (free port) in a daemon thread: the demo site, or a stub login page at every path."""
    handler = type("H", (_Handler,), {"login_only": login_only})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


_SITE: dict = {}
_LOCK = threading.RLock()  # episodes reset on several threads at once (esopt_mp.envs.base.call_envs)


def site_url() -> str:
    with _LOCK:
        if "url" not in _SITE:
            _SITE["server"], _SITE["url"] = serve()
        return _SITE["url"]


def tasks(n: int, first_seed: int = 0, url: str | None = None) -> list[dict]:
    """``n`` demo tasks (kinds alternate, seeds from ``first_seed``) as environment task dicts, on ``url``'s site."""
    return [{"id": f"demo.{KINDS[s % 2]}.{s}", "gym_id": f"browsergym/esopt_demo.{KINDS[s % 2]}", "seed": s,
             **({"url": url} if url else {})} for s in range(first_seed, first_seed + n)]


def register() -> None:
    """Register ``browsergym/esopt_demo.{form,code}`` (once per process)."""
    with _LOCK:
        if not _SITE.get("registered"):
            _register()


def _register() -> None:
    from browsergym.core.registration import register_task
    from browsergym.core.task import AbstractBrowserTask

    class DemoTask(AbstractBrowserTask):
        def __init__(self, seed: int, kind: str = "form", url: str | None = None):
            super().__init__(seed)
            self.kind, self.seed, self.url = kind, seed, url
            self.slow_mo, self.timeout = 0, 10000
            self.viewport = {"width": 1024, "height": 600}

        @classmethod
        def get_task_id(cls):
            return "esopt_demo"

        def setup(self, page):
            page.goto(f"{self.url or site_url()}/?seed={self.seed}")
            if self.kind == "form":
                return f"Type {NAMES[self.seed % len(NAMES)]} into the Name field and submit the form.", {}
            return "What is the secret code on the page? Answer with send_msg_to_user.", {}

        def teardown(self):
            pass

        def validate(self, page, chat_messages):
            if self.kind == "form":
                if "/result" not in page.url:
                    return 0.0, False, "", {}
                name = urllib.parse.parse_qs(urllib.parse.urlparse(page.url).query).get("name")
                return float(name == [NAMES[self.seed % len(NAMES)]]), True, "", {"submitted": name}
            users = [i for i, m in enumerate(chat_messages) if m["role"] == "user"]  # the goal; before it: greeting
            answers = [m["message"] for m in chat_messages[users[0] + 1 if users else 0:] if m["role"] == "assistant"]
            if not answers:
                return 0.0, False, "", {}
            return float(str(code_of(self.seed)) in answers[-1]), True, "", {"answer": answers[-1]}

    for kind in KINDS:
        register_task(f"esopt_demo.{kind}", DemoTask, task_kwargs={"kind": kind}, default_task_kwargs={"url": None})
    _SITE["registered"] = True
