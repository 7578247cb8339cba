"""The suite's layout (tests/README.md): every test directory is collected by the README's test command (pytest
skips directories matching its ``norecursedirs``, whose default includes ``dist`` and ``build``: the distributed tests
once sat, uncollected, in tests/dist), and a unit test cannot start a process."""
import fnmatch
import os

import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_no_test_directory_matches_norecursedirs(request):
    patterns = request.config.getini("norecursedirs")
    dirs = [d for d in os.listdir(TESTS) if os.path.isdir(os.path.join(TESTS, d))
            and any(f.startswith("test_") and f.endswith(".py") for f in os.listdir(os.path.join(TESTS, d)))]
    assert {"unit", "integration", "distributed"} <= set(dirs) and "e2e" not in dirs
    skipped = [d for d in dirs if any(fnmatch.fnmatch(d, p) for p in patterns)]
    assert not skipped, f"pytest would never collect tests/{skipped}: norecursedirs {patterns}"


def test_ci_runs_the_readme_test_command():
    """.ci/run calls the same pytest command the README gives a newcomer (options included)."""
    import re

    root = os.path.dirname(TESTS)
    readme = open(os.path.join(root, "README.md"), encoding="utf-8").read()
    (cmd,) = re.findall(r'pip install -e "\.\[test\]" && (python -m pytest[^\n]*)', readme)
    ci = [line.split("#")[0].strip() for line in open(os.path.join(root, ".ci", "run"), encoding="utf-8")]
    assert cmd.strip() in ci, (cmd, [c for c in ci if "pytest" in c])


@pytest.mark.parametrize("start", ["subprocess", "fork", "multiprocessing"])
def test_a_unit_test_that_starts_a_process_fails_naming_it(start):
    """tests/unit/conftest.py refuses every way a test here could start a child (so a whole-run or subprocess test
    put here fails at once, with where it belongs)."""
    import multiprocessing
    import subprocess

    with pytest.raises(RuntimeError, match=r"a unit test started a process .*tests/integration") as e:
        if start == "subprocess":
            subprocess.run(["true"])
        elif start == "fork":
            os.fork()
        else:
            multiprocessing.get_context("spawn").Process(target=print).start()
    assert start != "subprocess" or "'true'" in str(e.value)


def test_unit_folders_mirror_the_package():
    """tests/unit/<name>/ holds the tests of esopt_mp/<name>/: a folder that names no package is a drawer."""
    pkg = os.path.join(os.path.dirname(TESTS), "esopt_mp")
    unit = os.path.join(TESTS, "unit")
    folders = [d for d in os.listdir(unit) if os.path.isdir(os.path.join(unit, d)) and not d.startswith("__")]
    assert folders, "tests/unit has no package folders"
    strays = [d for d in folders if not os.path.isfile(os.path.join(pkg, d, "__init__.py"))]
    assert not strays, f"tests/unit/{strays} name no package of esopt_mp"
    for d in folders:  # collected as packages: two test files of one name in two folders do not collide
        assert os.path.isfile(os.path.join(unit, d, "__init__.py")), d
