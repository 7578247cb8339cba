"""A harness command's environment and its output on the trainer's log: what of the trainer's environment a
command sees (never secrets nor a launcher's rendezvous), the member's endpoint under ``ESOPT_*`` and
``OPENAI_*``, and model text escaped onto one line. Plain Python."""
from __future__ import annotations

import os

# what a command's environment keeps of the trainer's (besides objective.env): where programs and libraries are,
# the user, locale, time zone, temporary files, proxies and certificates; never secrets nor a launcher's rendezvous
PASSED_ENV = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR", "PWD",
              "PYTHONPATH", "VIRTUAL_ENV", "CONDA_PREFIX", "LD_LIBRARY_PATH", "SSL_CERT_FILE", "SSL_CERT_DIR",
              "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy",
              "https_proxy", "no_proxy", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
              "ROCR_VISIBLE_DEVICES", "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "HF_HUB_OFFLINE",
              "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
PASSED_PREFIXES = ("LC_", "XDG_")
# a launcher's rendezvous and rank variables: a harness using torch.distributed, accelerate or MPI would join the
# trainer's world with them
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK",
                "CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE")
LAUNCHER_PREFIXES = ("TORCHELASTIC_", "TORCH_ELASTIC_", "OMPI_COMM_WORLD_", "PMI_", "PMIX_")
OPENAI_ENV = ("OPENAI_BASE_URL", "OPENAI_API_KEY", "OPENAI_MODEL")
ENV_NAME = r"[A-Za-z_][A-Za-z0-9_]*"


def is_launcher_var(name: str) -> bool:
    return name in LAUNCHER_ENV or name.startswith(LAUNCHER_PREFIXES)


def harness_env(base_url: str, model: str, api_key: str, passed=(), openai_env: str = "member",
                environ=None) -> dict:
    """A command's environment: the trainer's variables of :data:`PASSED_ENV` and ``passed`` (``objective.env``),
    never a launcher's rendezvous ones; the member as ``ESOPT_BASE_URL``, ``ESOPT_API_KEY`` ("none" without a key)
    and ``ESOPT_MODEL``, and as ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` and ``OPENAI_MODEL`` unless
    ``openai_env="user"`` (then the trainer's own OPENAI_* reach the harness unchanged, e.g. for an LLM judge)."""
    environ = os.environ if environ is None else environ
    env = {k: v for k, v in environ.items()
           if (k in PASSED_ENV or k.startswith(PASSED_PREFIXES) or k in passed) and not is_launcher_var(k)}
    member = {"BASE_URL": base_url, "API_KEY": api_key or "none", "MODEL": model}
    env.update({f"ESOPT_{k}": v for k, v in member.items()})
    if openai_env == "user":
        env.update({k: v for k, v in environ.items() if k.startswith("OPENAI_")})
    else:
        env.update({f"OPENAI_{k}": v for k, v in member.items()})
    return env


_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7f, *range(0x80, 0xa0)]}
_CONTROL.update({0x09: "\\t", 0x0a: "\\n", 0x0d: "\\r", 0x2028: "\\u2028", 0x2029: "\\u2029",
                 **{c: f"\\u{c:04x}" for c in [0x200e, 0x200f, *range(0x202a, 0x202f), *range(0x2066, 0x206a)]}})


def escape(text: str) -> str:
    """``text`` on one line, its control characters (line breaks, escape sequences, bidirectional overrides)
    written as escapes: a harness's output (model text) cannot forge a line of the trainer's log."""
    return text.translate(_CONTROL)
