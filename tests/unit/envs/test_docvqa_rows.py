"""DocVQA rows name images inside the dataset's folder only: the environment copies a row's image into the sandbox,
so a row naming any other file would hand it to the model."""
import json
import os

import pytest

from esopt_mp.envs.docvqa import load_jsonl


def _write(path, images):
    with open(path, "w") as f:
        for i, image in enumerate(images):
            f.write(json.dumps({"id": f"r{i}", "question": "q?", "answers": ["a"], "image": image}) + "\n")
    return str(path)


@pytest.fixture
def layout(tmp_path):
    data = tmp_path / "data"
    (data / "documents").mkdir(parents=True)
    (data / "documents" / "p1.png").write_bytes(b"png")
    (tmp_path / "secret.png").write_bytes(b"not the dataset's")
    os.symlink(tmp_path / "secret.png", data / "documents" / "link.png")
    return tmp_path, data


def test_images_inside_the_folder_are_read(layout):
    _, data = layout
    rows = load_jsonl(_write(data / "val.jsonl", ["documents/p1.png", "./documents/../documents/p1.png"]))
    assert [os.path.realpath(r["image"]) for r in rows] == [str((data / "documents" / "p1.png").resolve())] * 2


@pytest.mark.parametrize("kind", ["absolute", "dotdot", "symlink-out", "not-a-string"])
def test_a_row_naming_a_file_outside_the_folder_is_refused_naming_the_row(layout, kind):
    root, data = layout
    image = {"absolute": str(root / "secret.png"), "dotdot": "../secret.png", "symlink-out": "documents/link.png",
             "not-a-string": ["documents/p1.png"]}[kind]
    path = _write(data / "val.jsonl", ["documents/p1.png", image])
    with pytest.raises(ValueError, match=r"val\.jsonl: row r1: image .*(outside the dataset's folder|must be a path)"):
        load_jsonl(path)


def test_an_image_swapped_for_a_link_after_the_rows_were_read_is_refused_at_reset(tmp_path):
    """The row was checked when read; the file is then replaced by a link to a secret (a writable shared folder):
    reset refuses it rather than copy the secret into the sandbox's page."""
    from esopt_mp.envs.docvqa import _copy_checked

    data = tmp_path / "data"
    data.mkdir()
    (data / "p.png").write_bytes(b"png")
    (tmp_path / "secret").write_text("root:x")
    image = os.path.realpath(data / "p.png")
    _copy_checked(image, str(tmp_path / "ok.png"), "r1")
    assert (tmp_path / "ok.png").read_bytes() == b"png"
    os.remove(image)
    os.symlink(tmp_path / "secret", image)
    with pytest.raises(ValueError, match="without following a link"):
        _copy_checked(image, str(tmp_path / "page.png"), "r1")
    os.remove(image)
    (data / "p.png").write_bytes(b"png")
    os.rename(data, tmp_path / "moved")  # the folder swapped for a link to another folder holding p.png
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "p.png").write_text("root:x")
    os.symlink(tmp_path / "other", data)
    with pytest.raises(ValueError, match="now resolves to"):
        _copy_checked(image, str(tmp_path / "page.png"), "r1")
    assert not (tmp_path / "page.png").exists()
