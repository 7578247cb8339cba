"""The ``endpoint`` section: where a member is served and how its requests are batched. Plain Python.

Not part of the config hash: where and how fast a member is served never changes what it answers.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re

from esopt_mp.chat.toolcalls import PARSERS
from esopt_mp.typed import check


class EndpointError(RuntimeError):
    """The endpoint cannot start or serve as configured (one line, naming the setting)."""


@dataclasses.dataclass
class EndpointConfig:
    host: str = "127.0.0.1"  # loopback: only programs on this machine reach the member
    port: int = 0  # 0: a free port per TP leader; else port + dp_rank
    api_key_env: str = ""  # name of the environment variable holding the bearer key ("": no key)
    batch_window_s: float = 1.0  # longest wait for the other live episodes' requests before a batch is generated
    tool_parser: str = "hermes"  # how tool calls are read from a reply
    allow_unauthenticated: bool = False  # serve a non-loopback host without a key (whoever reaches it runs the member)
    max_body_bytes: int = 4 * 1024 * 1024  # a larger request body is refused (413) before it is read in full
    max_connections: int = 256  # open connections; more are refused at once (each holds a file descriptor)
    request_timeout_s: float = 30.0  # a connection must send a whole request within this long, else it is closed

    def validate(self, key: str = "endpoint") -> None:
        check(bool(self.host.strip()), f"{key}.host", "must name an address to bind, e.g. 127.0.0.1")
        check(0 <= self.port <= 65535, f"{key}.port", f"must be in [0, 65535] (0: a free port), got {self.port}")
        check(not self.api_key_env or re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.api_key_env) is not None,
              f"{key}.api_key_env", f"must be an environment variable's name or '', got {self.api_key_env!r}")
        check(math.isfinite(self.batch_window_s) and self.batch_window_s >= 0, f"{key}.batch_window_s",
              f"must be a finite number >= 0, got {self.batch_window_s}")
        check(self.tool_parser in PARSERS, f"{key}.tool_parser",
              f"unknown tool-call parser {self.tool_parser!r}; known: {', '.join(sorted(PARSERS))}")
        check(bool(self.api_key_env) or self.allow_unauthenticated or loopback(self.host), f"{key}.host",
              f"{self.host} is not a loopback address (other machines may reach it): set {key}.api_key_env "
              f"(a bearer key), or {key}.allow_unauthenticated=true to serve it without one")
        for name in ("max_body_bytes", "max_connections"):
            v = getattr(self, name)
            check(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"{key}.{name}",
                  f"must be an integer >= 1, got {v!r}")
        check(math.isfinite(self.request_timeout_s) and self.request_timeout_s > 0, f"{key}.request_timeout_s",
              f"must be a finite number > 0, got {self.request_timeout_s}")

    def api_key(self) -> str:
        """The bearer key requests must send ('' for none), read from ``api_key_env`` now."""
        if not self.api_key_env:
            return ""
        key = os.environ.get(self.api_key_env, "")
        if not key:
            raise EndpointError(f"endpoint.api_key_env={self.api_key_env}: the environment variable "
                                f"{self.api_key_env} is unset or empty; set it to the key, or endpoint.api_key_env=''")
        return key


def loopback(host: str) -> bool:
    """Whether ``host`` is reachable only from this machine (localhost, 127.0.0.0/8, ::1)."""
    h = host.strip().strip("[]").lower()
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False
