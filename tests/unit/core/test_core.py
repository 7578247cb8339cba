"""The shared words: the failure kinds and errors every layer speaks of, and the one file digest; the package
imports nothing of esopt_mp, so any layer may import it."""
import ast
import hashlib
import os

import esopt_mp.core as core
from esopt_mp.core.errors import FAILURE_KINDS, InfraError, StartupError
from esopt_mp.core.files import file_sha256


def test_failure_kinds_and_errors():
    assert FAILURE_KINDS == ("model", "wall_clock", "infra")
    assert issubclass(InfraError, RuntimeError) and issubclass(StartupError, RuntimeError)
    assert not issubclass(InfraError, StartupError) and not issubclass(StartupError, InfraError)


def test_file_sha256_streams_any_size_to_hashlibs_digest(tmp_path):
    data = os.urandom(3 * 1000 + 7)
    p = tmp_path / "f"
    p.write_bytes(data)
    want = hashlib.sha256(data).hexdigest()
    assert file_sha256(str(p)) == want and file_sha256(str(p), block=1000) == want and file_sha256(str(p), block=1) == want
    (tmp_path / "empty").write_bytes(b"")
    assert file_sha256(str(tmp_path / "empty")) == hashlib.sha256(b"").hexdigest()


def test_core_imports_nothing_of_esopt_mp():
    folder = os.path.dirname(core.__file__)
    for f in os.listdir(folder):
        if f.endswith(".py"):
            tree = ast.parse(open(os.path.join(folder, f)).read())
            mods = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
            mods += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
            assert not [m for m in mods if m.startswith("esopt_mp")], f


def test_a_members_old_home_still_answers_with_a_notice():
    """``esopt_mp.es.seeds.Member`` (its home before core/types.py) is the same class, with a one-line notice, and
    a member built the old way (no ``pair``) still builds (pair -1: its index)."""
    import pytest

    import esopt_mp.es.seeds as seeds
    from esopt_mp.core.types import Member

    with pytest.warns(DeprecationWarning, match="esopt_mp.es.seeds.Member is now esopt_mp.core.types.Member"):
        old = seeds.Member
    assert old is Member and old(0, 3, 5, 1).pair == -1
    with pytest.raises(AttributeError):
        seeds.NotAName  # noqa: B018
