"""Context files are durable like the ledger that names them: the file is fsynced before its rename, and the
rename (and a new contexts/ folder) are fsynced in their folder, so a crash cannot leave a ledger entry whose
context file is missing."""
import os
import stat

from esopt_mp.prompt.base import ContextStore, context_hash


def _record_fsyncs(monkeypatch) -> list:
    seen, real = [], os.fsync

    def fsync(fd):
        st = os.fstat(fd)
        path = os.readlink(f"/proc/self/fd/{fd}")
        text = None if stat.S_ISDIR(st.st_mode) else open(path, encoding="utf-8").read()
        seen.append((path, stat.S_ISDIR(st.st_mode), text, sorted(os.listdir(path)) if stat.S_ISDIR(st.st_mode)
                     else None))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def test_a_new_context_file_and_its_folders_are_fsynced_in_order(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    seen = _record_fsyncs(monkeypatch)
    h = ContextStore(str(run)).put("## Skill\n- be brief\n")
    contexts, name = str(run / "contexts"), f"{h}.txt"
    files = [s for s in seen if not s[1]]
    dirs = {s[0]: s[3] for s in seen if s[1]}
    assert [text for _, _, text, _ in files] == ["## Skill\n- be brief\n"]  # the file, before its rename
    assert name in dirs[contexts]  # the folder, after the rename
    assert "contexts" in dirs[str(run)]  # the new folder's own entry
    assert context_hash(open(os.path.join(contexts, name)).read()) == h


def test_a_second_context_fsyncs_its_file_and_folder_only_and_a_known_one_writes_nothing(tmp_path, monkeypatch):
    store = ContextStore(str(tmp_path))
    store.put("first")
    seen = _record_fsyncs(monkeypatch)
    store.put("second")
    assert [(p, d) for p, d, *_ in seen][1:] == [(str(tmp_path / "contexts"), True)] and not seen[0][1]
    seen.clear()
    store.put("second")
    assert seen == []
