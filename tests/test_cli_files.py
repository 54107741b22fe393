"""Files the lowbit command writes are atomic (docs/cli.md, "Files"): an interrupted gen-data leaves the
previous dataset intact and no staging folder; a new dataset replaces the old one as a whole; the helpers of
lowbit.toolchain.files keep the old file or entries when writing fails."""

import json
import os

import pytest

from lowbit.cli import main as cli
from lowbit.toolchain import files
from lowbit.toolchain import wqbmm as sample

SMALL = ["--m", "2", "--n", "64", "--k", "64", "--group-size", "32"]


def snapshot(root):
    """Every file under ``root`` (hidden ones included) -> its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def dataset(tmp_path):
    root = tmp_path / "data"
    assert cli.main(["wqbmm", "gen-data", "--dir", str(root), *SMALL, "--seed", "5"]) == 0
    assert cli.main(["wqbmm", "run", "--dir", str(root), "--backend", "reference"]) == 0
    return root


def _fail_on_call(number, exc):
    """A write_bytes_atomic that writes the first number - 1 files, then raises ``exc``."""
    calls = []

    def writer(path, data):
        calls.append(path)
        if len(calls) == number:
            raise exc
        files.write_bytes_atomic(path, data)

    return writer


@pytest.mark.parametrize("exc,code", [(OSError(28, "No space left on device"), 2), (KeyboardInterrupt(), 130)])
def test_interrupted_gen_data_keeps_the_previous_dataset(dataset, monkeypatch, capsys, exc, code):
    before = snapshot(dataset)
    assert {"input/meta.json", "output/golden.bin", "output/output_z.bin"} <= set(before)
    monkeypatch.setattr(sample, "write_bytes_atomic", _fail_on_call(3, exc))  # after x and the weight
    assert cli.main(["wqbmm", "gen-data", "--dir", str(dataset), *SMALL, "--seed", "6"]) == code
    assert capsys.readouterr().err.count("\n") == 1
    assert snapshot(dataset) == before  # no new input beside the old golden, no staging folder left
    assert not [p for p in dataset.iterdir() if p.name.startswith(".")]


def test_new_dataset_replaces_the_old_one_as_a_whole(dataset):
    old_golden = (dataset / "output/golden.bin").read_bytes()
    assert cli.main(["wqbmm", "gen-data", "--dir", str(dataset), *SMALL, "--seed", "6"]) == 0
    assert json.loads((dataset / "input/meta.json").read_text())["seed"] == 6
    assert (dataset / "output/golden.bin").read_bytes() != old_golden
    assert not (dataset / "output/output_z.bin").exists()  # the old data's output does not survive
    assert not list(dataset.rglob(".*"))


def test_gen_data_keeps_unrelated_files_of_the_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    assert cli.main(["wqbmm", "gen-data", "--dir", str(tmp_path), *SMALL]) == 0
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["input", "input_input_weight_real.bin", "notes.txt", "output"]


def test_failed_run_keeps_the_previous_output(dataset, monkeypatch, capsys):
    before = snapshot(dataset)

    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(sample, "tensor_bytes", broken)
    assert cli.main(["wqbmm", "run", "--dir", str(dataset)]) == 2
    assert "kernel exploded" in capsys.readouterr().err
    assert snapshot(dataset) == before


def test_profile_traces_leave_no_temporary_files(dataset, capsys):
    assert cli.main(["wqbmm", "profile", "--dir", str(dataset), "--backends", "reference", "--repeats", "1"]) == 0
    traces = sorted(p.name for p in (dataset / "output/profile").iterdir())
    assert traces == ["basic_reference.json", "preload_reference.json"]
    assert json.loads((dataset / "output/profile/basic_reference.json").read_text())


def test_atomic_path_keeps_the_old_file_on_error(tmp_path):
    target = tmp_path / "out.bin"
    files.write_bytes_atomic(target, b"old")
    with pytest.raises(ZeroDivisionError):
        with files.atomic_path(target) as tmp:
            tmp.write_bytes(b"half")
            1 / 0
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["out.bin"]
    files.write_bytes_atomic(target, b"new")
    assert target.read_bytes() == b"new" and os.listdir(tmp_path) == ["out.bin"]


def test_staged_entries_put_the_old_entries_back_when_a_rename_fails(tmp_path, monkeypatch):
    for name in ("a", "b"):
        (tmp_path / name).write_text(f"old {name}")
    real_rename = os.rename
    calls = []

    def rename(src, dst):
        calls.append(src)
        if len(calls) == 4:  # a and b renamed aside, new a renamed in, then new b fails
            raise OSError(5, "I/O error")
        real_rename(src, dst)

    monkeypatch.setattr(files.os, "rename", rename)
    with pytest.raises(OSError, match="I/O error"):
        with files.staged_entries(tmp_path, ["a", "b"]) as staging:
            for name in ("a", "b"):
                (staging / name).write_text(f"new {name}")
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == {"a": "old a", "b": "old b"}


def test_read_tensor_names_the_file(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(b"\0" * 6)
    with pytest.raises(files.DatasetError, match="x.bin: 6 bytes, expected 8"):
        files.read_tensor(path, sample.DTYPES["float16"], (2, 2))


def test_a_failed_atomic_write_names_the_target_not_the_temporary_file(tmp_path):
    (tmp_path / "adir").mkdir()
    with pytest.raises(IsADirectoryError) as caught:  # the rename over a directory fails
        files.write_bytes_atomic(tmp_path / "adir", b"x")
    assert f"cannot write {tmp_path / 'adir'}" in str(caught.value) and ".adir." not in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir"]  # the temporary file is gone

    def fail_in_block(tmp):
        raise PermissionError(13, "Permission denied", str(tmp))

    with pytest.raises(PermissionError, match=f"cannot write {tmp_path / 'x.bin'}: Permission denied"):
        with files.atomic_path(tmp_path / "x.bin") as tmp:
            fail_in_block(tmp)
    with pytest.raises(PermissionError, match="other.bin"):  # an error about another file keeps its name
        with files.atomic_path(tmp_path / "x.bin"):
            fail_in_block(tmp_path / "other.bin")


def test_a_full_disk_names_the_target(tmp_path, monkeypatch):
    def full(self, data):  # a write's error names no file
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.Path, "write_bytes", full)
    with pytest.raises(OSError, match=f"cannot write {tmp_path / 'x.bin'}: No space left on device"):
        files.write_bytes_atomic(tmp_path / "x.bin", b"x")
    monkeypatch.undo()
    (tmp_path / "file").write_text("x")  # a folder on the way is a file: named too
    with pytest.raises(OSError, match=f"cannot write {tmp_path / 'file' / 'x.bin'}: .*{tmp_path / 'file'}"):
        files.write_bytes_atomic(tmp_path / "file" / "x.bin", b"x")


def test_a_temporary_file_that_cannot_be_made_is_not_named_and_the_cli_line_has_no_errno(tmp_path, monkeypatch,
                                                                                          capsys):
    """mkstemp failing (a folder this process may not write in, as root under /sys) named the hidden temporary
    file, and the command's line began with [Errno 13]."""
    real = files.tempfile.mkstemp

    def refused(dir, prefix):
        raise PermissionError(13, "Permission denied", os.path.join(dir, prefix + "8elxhp1f"))

    monkeypatch.setattr(files.tempfile, "mkstemp", refused)
    with pytest.raises(PermissionError) as caught:
        files.write_bytes_atomic(tmp_path / "x.png", b"x")
    assert str(caught.value) == f"[Errno 13] cannot write {tmp_path / 'x.png'}: Permission denied"
    assert cli._one_line(caught.value) == f"cannot write {tmp_path / 'x.png'}: Permission denied"
    monkeypatch.setattr(files.tempfile, "mkstemp", real)


def test_save_quantized_errors_name_the_checkpoint(tmp_path, monkeypatch):
    import lowbit
    import torch
    from lowbit.cli.bench.model import quantized_layer

    model = torch.nn.Sequential(quantized_layer(torch.ones(8, 32).bfloat16(), torch.zeros(8).bfloat16(), "hif8-wo")[0])

    def read_only(path, mode):  # a file written into the temporary folder
        raise OSError(30, "Read-only file system", str(path))

    monkeypatch.setattr(os, "chmod", read_only)
    with pytest.raises(OSError, match=f"cannot write {tmp_path / 'ckpt'}: Read-only file system"):
        lowbit.save_quantized(model, tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


def test_output_paths_are_checked_when_parsed(tmp_path, monkeypatch):
    import argparse

    from lowbit.cli import argtypes

    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    with pytest.raises(argparse.ArgumentTypeError, match="is a directory, expected a file name"):
        argtypes.output_file(str(tmp_path / "adir"))
    with pytest.raises(argparse.ArgumentTypeError, match="exists and is not a directory"):
        argtypes.output_dir(str(tmp_path / "afile"))
    assert argtypes.output_file("") == "" and argtypes.output_file("-") == "-"
    new = str(tmp_path / "new" / "deeper" / "x.png")  # its folders are made when it is written
    assert argtypes.output_file(new) == new and argtypes.output_dir(str(tmp_path / "new")) == str(tmp_path / "new")
    monkeypatch.setattr(argtypes.os, "access", lambda path, mode: False)  # (root may write anywhere)
    with pytest.raises(argparse.ArgumentTypeError, match=f"{tmp_path} is not a directory this process may write in"):
        argtypes.output_file(new)
