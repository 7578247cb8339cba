"""A proposer on a separate OpenAI-compatible endpoint (``prompt.skill.proposer=endpoint``).

``POST {url}/v1/chat/completions`` (``url`` may already end in ``/v1``) with the key read from the environment
variable ``prompt.skill.key_env`` at call time. The ``openai`` client is used when it is installed, plain
``urllib`` otherwise; nothing is imported or contacted before the first proposal. The request carries the
proposal's seed; whether the endpoint honours it (and so replays) is the endpoint's affair: the ledger stores
every context version, so a replay reads the skill rather than asking again.
"""
from __future__ import annotations

import json
import os
import urllib.request


class EndpointProposer:
    def __init__(self, url: str, model: str, key_env: str = "OPENAI_API_KEY", max_tokens: int = 512,
                 temperature: float = 0.7, timeout_s: float = 120.0):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"prompt.skill.url must be an http(s) URL, got {url!r}")
        self.base = url.rstrip("/") if url.rstrip("/").endswith("/v1") else url.rstrip("/") + "/v1"
        self.model, self.key_env = model, key_env
        self.max_tokens, self.temperature, self.timeout_s = max_tokens, temperature, timeout_s

    def _key(self) -> str:
        return os.environ.get(self.key_env, "") if self.key_env else ""

    def __call__(self, prompt: str, seed: int) -> str:
        messages = [{"role": "user", "content": prompt}]
        try:
            import openai
        except ImportError:
            openai = None
        if openai is not None:
            client = openai.OpenAI(base_url=self.base, api_key=self._key() or "none", timeout=self.timeout_s,
                                   max_retries=0)  # timeout_s bounds the request: no hidden retries
            r = client.chat.completions.create(model=self.model, messages=messages, max_tokens=self.max_tokens,
                                               temperature=self.temperature, seed=seed % (1 << 31))
            return r.choices[0].message.content or ""
        body = json.dumps({"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
                           "temperature": self.temperature, "seed": seed % (1 << 31)}).encode()
        headers = {"Content-Type": "application/json"}
        if self._key():
            headers["Authorization"] = f"Bearer {self._key()}"
        req = urllib.request.Request(f"{self.base}/chat/completions", data=body, headers=headers, method="POST")
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            data = json.loads(resp.read().decode())
        try:
            return data["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise ValueError(f"prompt.skill.url: no choices[0].message.content in the answer: {str(data)[:200]}") \
                from None
