"""prhs_hf.hub.jsonl: the one JSON Lines reader (data sets, prompts, samples, RULER files)."""

from __future__ import annotations

import gzip

import pytest

from prhs_hf.hub.jsonl import JSONLError, read_jsonl, read_jsonl_records

LINES = '{"a": 1}\n\n  \n{"a": 2}\n[3]\n'


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_records_with_their_line_numbers_blank_lines_skipped(tmp_path, suffix):
    path = tmp_path / f"rows{suffix}"
    if suffix.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            fh.write(LINES)
    else:
        path.write_text(LINES, encoding="utf-8")
    assert list(read_jsonl(path)) == [(1, {"a": 1}), (4, {"a": 2}), (5, [3])]
    assert read_jsonl_records(path) == [{"a": 1}, {"a": 2}, [3]]
    assert read_jsonl_records(path, limit=2) == [{"a": 1}, {"a": 2}]
    assert read_jsonl_records(path, limit=0) == []


def test_a_line_that_is_not_json_names_the_file_and_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\n{"a": \n', encoding="utf-8")
    rows = read_jsonl(path)
    assert next(rows) == (1, {"a": 1})
    with pytest.raises(JSONLError, match=r"bad\.jsonl:2: not JSON"):
        next(rows)
    assert issubclass(JSONLError, ValueError)


def test_limit_stops_reading_before_a_later_bad_line(tmp_path):
    path = tmp_path / "tail.jsonl"
    path.write_text('{"a": 1}\nnot json\n', encoding="utf-8")
    assert read_jsonl_records(path, limit=1) == [{"a": 1}]


def test_undecodable_bytes_can_be_replaced(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"text": "caf\xe9"}\n')
    with pytest.raises(UnicodeDecodeError):
        list(read_jsonl(path))
    assert [r for _, r in read_jsonl(path, errors="replace")] == [{"text": "caf\ufffd"}]
