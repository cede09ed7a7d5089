"""The golden assertion (``compiler.testing.golden``): it passes on equal text, fails on a difference
with a diff excerpt and how to update, writes the golden under the update switch (the argument, the
environment variable), and refuses a golden it cannot read in one line naming the file and the line."""

from __future__ import annotations

from pathlib import Path

import pytest

from compiler.testing import golden
from compiler.testing.golden import GoldenError, GoldenFileError, GoldenMismatch, assert_golden, assert_golden_ir, read_golden
from ir.batch import DecodeBatch
from ir.printer import dump
from tests.helpers import GOLDEN

RUNNING = DecodeBatch(rids=[20, 21], slots=[4, 5], seq_lens=[9, 12], input_ids=[50, 51], kv_locs=[60, 61])


@pytest.fixture(autouse=True)
def _no_update_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(golden.UPDATE_ENV, raising=False)


def test_equal_text_passes_and_a_difference_fails_with_a_diff_and_how_to_update(tmp_path: Path) -> None:
    path = tmp_path / "pass.txt"
    path.write_text("line one\nline two\nline three\n")
    assert_golden("line one\nline two\nline three\n", path)
    with pytest.raises(GoldenMismatch) as info:
        assert_golden("line one\nline 2\nline three\n", path)
    message = str(info.value)
    first, *diff = message.splitlines()
    assert first.startswith(f"{path}: the output differs from the golden file (1 line(s)); ")
    assert "--batchc-update-golden" in first and "BATCHC_UPDATE_GOLDEN=1" in first
    assert diff[:2] == [f"--- {path} (golden)", "+++ actual"]
    assert "-line two" in diff and "+line 2" in diff and " line one" in diff
    assert path.read_text() == "line one\nline two\nline three\n"  # a failure writes nothing


def test_a_missing_final_newline_is_a_difference(tmp_path: Path) -> None:
    path = tmp_path / "g.txt"
    path.write_text("x\n")
    with pytest.raises(GoldenMismatch, match=r"\(1 line\(s\)\)") as info:
        assert_golden("x", path)
    assert "\\ No newline at end of file" in str(info.value)


def test_a_long_diff_is_cut_to_an_excerpt(tmp_path: Path) -> None:
    path = tmp_path / "long.txt"
    path.write_text("".join(f"old {i}\n" for i in range(100)))
    with pytest.raises(GoldenMismatch) as info:
        assert_golden("".join(f"new {i}\n" for i in range(100)), path)
    lines = str(info.value).splitlines()
    assert "(100 line(s))" in lines[0]
    assert lines[-1].startswith("... and ") and lines[-1].endswith(" more diff lines")
    assert len(lines) == 1 + 40 + 1


def test_the_update_switch_writes_the_golden_and_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "new" / "dir" / "pass.txt"
    assert_golden("written\n", path, update=True)
    assert path.read_text() == "written\n"
    with pytest.raises(GoldenMismatch):
        assert_golden("changed\n", path, update=False)
    monkeypatch.setenv(golden.UPDATE_ENV, "1")
    assert golden.update_requested()
    assert_golden("changed\n", path)
    assert path.read_text() == "changed\n"


def test_update_false_compares_even_when_the_environment_asks_for_updates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "g.txt"
    path.write_text("kept\n")
    monkeypatch.setenv(golden.UPDATE_ENV, "1")
    with pytest.raises(GoldenMismatch):
        assert_golden("other\n", path, update=False)
    assert path.read_text() == "kept\n"


@pytest.mark.parametrize("value", ["", "0"])
def test_the_environment_switch_is_off_unless_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(golden.UPDATE_ENV, value)
    assert not golden.update_requested()
    with pytest.raises(GoldenFileError):
        assert_golden("x\n", tmp_path / "absent.txt")
    assert not (tmp_path / "absent.txt").exists()


def test_a_bad_environment_switch_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(golden.UPDATE_ENV, "yes")
    with pytest.raises(ValueError, match=r"^BATCHC_UPDATE_GOLDEN must be 0 or 1 \(or unset\), got 'yes'$"):
        assert_golden("x\n", tmp_path / "g.txt")


def test_a_missing_golden_names_the_file_and_the_switch(tmp_path: Path) -> None:
    path = tmp_path / "absent.txt"
    with pytest.raises(GoldenFileError) as info:
        assert_golden("x\n", path)
    assert str(info.value) == f"golden file {path} is missing: run with --batchc-update-golden (or BATCHC_UPDATE_GOLDEN=1) to write it"


def test_a_golden_that_is_not_utf8_names_the_file_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "bad.txt"
    path.write_bytes(b"fine\nab\xffcd\n")
    with pytest.raises(GoldenFileError) as info:
        assert_golden("fine\n", path)
    assert str(info.value) == f"golden file {path}: line 2: not UTF-8 (byte 0xff at column 3)"
    with pytest.raises(GoldenFileError, match="line 2"):
        read_golden(path)


def test_an_ir_golden_must_parse_and_a_bad_one_names_the_file_and_the_line(tmp_path: Path) -> None:
    text = f"-- step 001 --\n{dump(RUNNING)}-- step 002 --\n{dump(RUNNING)}"
    path = tmp_path / "ir.txt"
    path.write_text(text)
    assert_golden_ir(text, path)
    broken = f"-- step 001 --\n{dump(RUNNING)}-- step 002 --\n{dump(RUNNING).replace('seq=12', 'seq=twelve')}"  # file line 8
    assert broken.splitlines()[7].strip().startswith("r1 s2 seq=twelve")
    path.write_text(broken)
    with pytest.raises(GoldenFileError) as info:
        assert_golden_ir(text, path)
    message = str(info.value)
    assert message.startswith(f"golden file {path}: line 8: not an IR dump: expected an integer") and "\n" not in message
    assert_golden(broken, path)  # (the plain assertion does not parse)


def test_the_update_switch_refuses_to_write_an_ir_golden_that_does_not_parse(tmp_path: Path) -> None:
    path = tmp_path / "ir.txt"
    with pytest.raises(GoldenError, match=rf"^the actual output for {path}: line 1: not an IR dump: unknown node kind") as info:
        assert_golden_ir("Batch requests=0\n", path, update=True)
    assert not isinstance(info.value, GoldenFileError) and not path.exists()


@pytest.mark.parametrize("path", sorted(p.relative_to(GOLDEN) for p in GOLDEN.glob("*.txt")) + sorted(p.relative_to(GOLDEN) for p in (GOLDEN / "spec").glob("*.txt")), ids=str)
def test_the_scenario_goldens_are_ir_dumps(path: Path) -> None:
    assert_golden_ir(read_golden(GOLDEN / path), GOLDEN / path, update=False)


def test_arguments_of_the_wrong_type_are_refused() -> None:
    from typeguard import suppress_type_checks

    with suppress_type_checks():
        with pytest.raises(TypeError, match=r"^assert_golden: actual must be the text \(str\) to compare, got bytes$"):
            assert_golden(b"x", "g.txt")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"^assert_golden_ir: path must be a str or a path, got int$"):
            assert_golden_ir("x", 3)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"^assert_golden: path must name a file, got ''$"):
            assert_golden("x", "")


def test_a_golden_with_a_byte_order_mark_says_so(tmp_path: Path) -> None:
    path = tmp_path / "bom.txt"
    path.write_bytes(b"\xef\xbb\xbf" + dump(RUNNING).encode())
    with pytest.raises(GoldenFileError) as info:
        assert_golden_ir(dump(RUNNING), path)
    assert str(info.value) == f"golden file {path}: line 1: starts with a UTF-8 byte-order mark (an editor added it): remove it"


@pytest.mark.parametrize(("golden_eol", "actual_eol"), [("\r\n", "\n"), ("\n", "\r\n")], ids=["crlf-golden", "crlf-output"])
def test_line_endings_alone_are_named_not_shown_as_equal_lines(tmp_path: Path, golden_eol: str, actual_eol: str) -> None:
    path = tmp_path / "eol.txt"
    path.write_bytes(dump(RUNNING).replace("\n", golden_eol).encode())
    with pytest.raises(GoldenMismatch) as info:
        assert_golden(dump(RUNNING).replace("\n", actual_eol), path)
    has, other = ("CRLF", "LF") if golden_eol == "\r\n" else ("LF", "CRLF")
    assert str(info.value) == (
        f"{path}: the golden file differs from the output only in its line endings ({has} where the output has {other}: a checkout "
        "that converts line endings, such as git's core.autocrlf, changed it); to accept the new output, rerun with "
        "--batchc-update-golden (or BATCHC_UPDATE_GOLDEN=1) and review the diff"
    )
    with pytest.raises(GoldenMismatch, match=r"\(1 line\(s\)\)"):  # a real difference besides the endings is shown as one
        assert_golden(dump(RUNNING).replace("seq=12", "seq=13").replace("\n", actual_eol), path)



def test_mixed_line_endings_are_named_as_they_are(tmp_path: Path) -> None:
    path = tmp_path / "mixed.txt"
    path.write_bytes(b"a\r\nb\n")
    with pytest.raises(GoldenMismatch, match=r"only in its line endings \(CRLF and LF where the output has CRLF: "):
        assert_golden("a\r\nb\r\n", path)
    with pytest.raises(GoldenMismatch, match=r"only in its line endings \(CRLF and LF where the output has LF: "):
        assert_golden("a\nb\n", path)


def test_an_output_that_starts_with_a_byte_order_mark_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "bom-out.txt"
    assert_golden("\ufeffx\n", path, update=True)  # (the output's own mark, written as it is)
    assert_golden("\ufeffx\n", path)
    with pytest.raises(GoldenFileError, match="byte-order mark"):
        assert_golden("x\n", path)  # (a mark the output lacks: named, not shown as a line that looks equal)


def test_a_golden_the_switch_cannot_write_is_one_line_naming_it(tmp_path: Path) -> None:
    folder = tmp_path / "a-folder"
    folder.mkdir()
    with pytest.raises(GoldenFileError) as info:
        assert_golden("x\n", folder, update=True)
    assert str(info.value) == f"golden file {folder} cannot be written: Is a directory"
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    inside = blocker / "golden" / "out.txt"
    with pytest.raises(GoldenFileError) as info:
        assert_golden("x\n", inside, update=True)
    assert str(info.value) == f"golden file {inside} cannot be written: Not a directory ({blocker / 'golden'})" and blocker.read_text() == "not a folder"
