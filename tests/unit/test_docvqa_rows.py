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
