"""Ledger durability: torn and glued lines, a crash at every byte, corruption that names its line."""
import json

import pytest

from esopt_mp.ledger import Ledger, LedgerError, decode_record, encode_record


def _rec(step):
    return {"step": step, "seeds": [step * 7 + 1, 3], "weights": [0.1 * step, -1 / 3], "alpha": 1e-3}


def _write(tmp_path, n, h="h"):
    tmp_path.mkdir(parents=True, exist_ok=True)
    led = Ledger(str(tmp_path), h, 0)
    for s in range(n):
        led.append(_rec(s))
    return led


def _steps(led):
    return [e["step"] for e in led.read()]


def test_records_roundtrip_and_any_changed_byte_invalidates():
    line = encode_record(_rec(3))
    assert line.endswith(b"}\n") and json.loads(line)["step"] == 3
    assert decode_record(line)["weights"] == _rec(3)["weights"]
    for i in range(len(line) - 1):  # every byte but the newline
        bad = line[:i] + bytes([line[i] ^ 0x01]) + line[i + 1:]
        assert decode_record(bad) is None, i
    assert decode_record(line[:-1]) is None  # complete record without its newline does not count


def test_issue_case_lost_newline_then_append_keeps_every_step(tmp_path):
    led = _write(tmp_path, 3)
    data = open(led.path, "rb").read()
    open(led.path, "wb").write(data[:-1])  # the crash lost only the trailing newline of step 2
    assert _steps(led) == [0, 1]
    led2 = Ledger(str(tmp_path), "h", 0)  # the restarted run
    assert [e["step"] for e in led2.repair()] == [0, 1]
    led2.append(_rec(2))
    led2.append(_rec(3))
    assert _steps(led2) == [0, 1, 2, 3]
    assert open(led.path, "rb").read().count(b"\n") == 4  # nothing glued


def test_crash_at_every_byte_of_an_append_then_resume(tmp_path):
    full = _write(tmp_path / "ref", 4)
    ref = open(full.path, "rb").read()
    cut3 = ref.index(b"\n", ref.index(b"\n", ref.index(b"\n") + 1) + 1) + 1  # end of step 2
    for n in range(len(ref) + 1):
        d = tmp_path / f"c{n}"
        d.mkdir()
        (d / "history.jsonl").write_bytes(ref[:n])
        led = Ledger(str(d), "h", 0)
        got = [e["step"] for e in led.repair()]
        assert got == list(range(ref[:n].count(b"\n"))), n
        for s in range(len(got), 4):
            led.append(_rec(s))
        assert (d / "history.jsonl").read_bytes() == ref, n
        if n == cut3:
            assert got == [0, 1, 2]


def test_zero_filled_tail_and_torn_middle_of_tail_are_dropped(tmp_path):
    led = _write(tmp_path, 2)
    with open(led.path, "ab") as f:
        f.write(b"\0" * 4096)
    led2 = Ledger(str(tmp_path), "h", 0)
    assert [e["step"] for e in led2.repair()] == [0, 1]
    led2.append(_rec(2))
    assert _steps(led2) == [0, 1, 2]


def test_glued_line_in_the_middle_is_an_error_naming_it(tmp_path):
    led = _write(tmp_path, 4)
    lines = open(led.path, "rb").read().splitlines(keepends=True)
    glued = lines[0] + lines[1][:-1] + lines[2] + lines[3]  # old bug: step 1 lost its newline, step 2 glued on
    open(led.path, "wb").write(glued)
    before = open(led.path, "rb").read()
    with pytest.raises(LedgerError, match="line 2 is corrupt"):
        Ledger(str(tmp_path), "h", 0).repair()
    assert open(led.path, "rb").read() == before  # never truncated silently


def test_flipped_byte_in_the_middle_is_an_error_naming_the_line(tmp_path):
    led = _write(tmp_path, 5)
    data = bytearray(open(led.path, "rb").read())
    start = data.index(b"\n", data.index(b"\n") + 1) + 1  # line 3
    data[start + 10] ^= 0x04
    open(led.path, "wb").write(bytes(data))
    with pytest.raises(LedgerError, match="line 3 is corrupt"):
        led.read()


def test_steps_must_be_consecutive(tmp_path):
    led = _write(tmp_path, 2)
    with open(led.path, "ab") as f:
        f.write(encode_record(dict(_rec(5), config_hash="h")))
    with pytest.raises(LedgerError, match="line 3 holds step 5, expected 2"):
        led.read()
    led2 = _write(tmp_path / "b", 2)
    with pytest.raises(LedgerError, match="appending step 4, expected step 2"):
        led2.append(_rec(4))


def test_other_config_and_legacy_lines_are_refused(tmp_path):
    _write(tmp_path, 2, h="aaaa")
    with pytest.raises(LedgerError, match="different configuration"):
        Ledger(str(tmp_path), "bbbb", 0).read()
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "history.jsonl").write_text("".join(json.dumps(dict(_rec(s), config_hash="h")) + "\n" for s in range(2))
                                          + encode_record(dict(_rec(2), config_hash="h")).decode())
    with pytest.raises(LedgerError, match="line 1 is corrupt"):
        Ledger(str(legacy), "h", 0).read()


def test_other_ranks_never_write(tmp_path):
    led = _write(tmp_path, 2)
    peer = Ledger(str(tmp_path), "h", 1)
    peer.append(_rec(2))
    peer.repair()
    assert _steps(led) == [0, 1]
    led.append(_rec(2))
    assert _steps(led) == [0, 1, 2]
