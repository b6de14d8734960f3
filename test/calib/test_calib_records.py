"""core.calib.load_calib_records: the shipped sets load; each malformed record is an error naming file and line.
Fixtures are generated in tmp_path (small PNGs written with PIL). References: literal record values/messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from msmodelslim.core.calib import CalibError, CalibRecord, load_calib_records, resolve_dataset
from msmodelslim.core.resources import resource_path


def make_set(tmp_path: Path, lines: list, name: str = "index.jsonl") -> Path:
    (tmp_path / "img").mkdir(exist_ok=True)
    Image.new("RGB", (8, 8), (10, 20, 30)).save(tmp_path / "img" / "a.png")
    index = tmp_path / name
    index.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return index


def test_mixed_records_with_default_text(tmp_path):
    index = make_set(tmp_path, [{"text": "hello", "image": "img/a.png"}, {"image": "img/a.png"},
                                {"text": "only text"}, "", {"image": "img/a.png", "text": ""}])
    records = load_calib_records(str(index), default_text="Describe.")
    image = (tmp_path / "img" / "a.png").resolve()
    assert records == [CalibRecord("hello", image), CalibRecord("Describe.", image), CalibRecord("only text"),
                       CalibRecord("Describe.", image)]


def test_directory_and_max_samples(tmp_path):
    make_set(tmp_path, [{"text": f"t{i}"} for i in range(5)] + ["{broken"])
    records = load_calib_records(str(tmp_path), "", max_samples=3)  # lines after the third record are not read
    assert [r.text for r in records] == ["t0", "t1", "t2"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", ":2: invalid JSON"),
        ({"text": "x", "caption": "y"}, ":2: unknown key 'caption'; expected one of text, image"),
        ({"text": 3}, ":2: 'text' must be a string"),
        ({"text": ""}, ":2: record has neither text nor image"),
        ({"text": "   "}, ":2: record has neither text nor image"),
        (["text"], ":2: expected a JSON object"),
        ({"image": "../outside.png"}, ":2: image path '../outside.png' escapes the dataset directory"),
        ({"image": "/etc/hostname.png"}, ":2: image path '/etc/hostname.png' escapes the dataset directory"),
        ({"image": "img/a.gif"}, ":2: image 'img/a.gif' has unsupported type '.gif'"),
        ({"image": "img/missing.png"}, ":2: image file not found"),
        ({"image": "img/fake.png"}, ":2: image 'img/fake.png' cannot be read as an image"),
        ({"image": 5}, ":2: 'image' must be a non-empty path string"),
    ],
)
def test_bad_record_names_file_and_line(tmp_path, line, message):
    index = make_set(tmp_path, [{"text": "fine"}, line])
    (tmp_path / "img" / "fake.png").write_bytes(b"not a png")
    with pytest.raises(CalibError) as info:
        load_calib_records(str(index), "Describe.")
    assert str(info.value).startswith(str(index))
    assert message in str(info.value)


def test_absolute_image_path_inside_the_dataset_is_allowed(tmp_path):
    index = make_set(tmp_path, [{"image": str(tmp_path / "img" / "a.png")}])
    assert load_calib_records(str(index), "d")[0].image == (tmp_path / "img" / "a.png").resolve()


def test_missing_and_empty_datasets(tmp_path):
    with pytest.raises(CalibError, match="calibration dataset not found"):
        load_calib_records(str(tmp_path / "none.jsonl"), "")
    with pytest.raises(CalibError, match=f"{tmp_path} has neither index.jsonl nor"):
        load_calib_records(str(tmp_path), "")
    with pytest.raises(CalibError, match="has no records"):
        load_calib_records(str(make_set(tmp_path, ["", ""])), "")
    with pytest.raises(CalibError, match="unknown calibration dataset 'noSuchSet'.*lab_calib has calibImages"):
        load_calib_records("noSuchSet", "")
    with pytest.raises(CalibError, match="max_samples must be positive"):
        load_calib_records("calibImages", "", max_samples=0)


def test_a_folder_of_jsonl_shards_is_read_in_name_order_up_to_max_samples(tmp_path):
    (tmp_path / "b.jsonl").write_text('{"text": "third"}\n{"text": "fourth"}\n')
    (tmp_path / "a.jsonl").write_text('{"text": "first"}\n\n{"text": "second"}\n')
    assert [r.text for r in load_calib_records(str(tmp_path), "")] == ["first", "second", "third", "fourth"]
    assert [r.text for r in load_calib_records(str(tmp_path), "", max_samples=3)] == ["first", "second", "third"]
    (tmp_path / "b.jsonl").write_text('{"text": "third"}\n{"txt": "bad"}\n')
    with pytest.raises(CalibError, match=r"b\.jsonl:2: unknown key 'txt'"):
        load_calib_records(str(tmp_path), "")


def test_shipped_image_text_set():
    assert resolve_dataset("calibImages") == [resource_path("lab_calib") / "calibImages" / "index.jsonl"]
    records = load_calib_records("calibImages", "Describe this image.")
    with_image = [r for r in records if r.image is not None]
    assert len(records) == 24 and len(with_image) == 20
    assert len({r.image for r in with_image}) == 16
    assert sum(r.text == "Describe this image." for r in records) == 4
    images = sorted((resource_path("lab_calib") / "calibImages" / "images").glob("*.png"))
    assert len(images) == 16
    for path in images:
        assert path.stat().st_size < 20_000, path
        with Image.open(path) as img:
            assert img.size == (224, 224)


def test_shipped_text_set_has_32_substantial_records():
    records = load_calib_records("kimi_text_calib", "")
    assert len(records) == 32 and all(r.image is None for r in records)
    words = [len(r.text.split()) for r in records]
    assert min(words) >= 100, words  # a few hundred tokens each


def test_make_images_reproduces_the_shipped_pngs():
    import runpy

    module = runpy.run_path(str(resource_path("lab_calib") / "make_images.py"))
    for name, draw in module["DRAWINGS"].items():
        shipped = Image.open(resource_path("lab_calib") / "calibImages" / "images" / f"{name}.png").convert("RGB")
        assert draw().tobytes() == shipped.tobytes(), name


def test_a_long_line_read_in_chunks_keeps_the_text_a_whole_parse_keeps(tmp_path):
    """`_cut_long_line` against json.loads of the whole line, then the same character budget: texts of escapes
    (quotes, backslashes, control characters, \\uXXXX with and without ensure_ascii, surrogate pairs) and multi-byte
    UTF-8, chunks of random sizes, budgets of 1-40 characters. Tolerance: none (the same string)."""
    import random

    from msmodelslim.core.calib import _cut_long_line

    rng = random.Random(0)
    alphabet = ["a", " ", "\n", "\\", '"', "é", "中", "😀", "\t", "\u2028", "/", "\x01"]
    for _ in range(1000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 300)))
        line = json.dumps({"text": text, "image": None}, ensure_ascii=rng.random() < 0.5).encode() + b"\n"
        budget = rng.randint(1, 40)
        cuts = sorted({0, len(line), *(rng.randrange(len(line)) for _ in range(rng.randint(0, 20)))})
        chunks = [line[a:b] for a, b in zip(cuts, cuts[1:])]
        kept = json.loads(_cut_long_line(iter(chunks), 12 * budget, "x").decode("utf-8"))["text"]
        assert kept[:budget] == text[:budget], (text, budget)


def test_a_record_far_longer_than_max_seq_len_is_cut_as_it_is_read(tmp_path):
    """A 32 MB record under max_seq_len 64: its text is cut to 64 * CHARS_PER_TOKEN characters (the same as
    cutting the whole text), and reading it allocates a bounded amount (tracemalloc's peak, a few MiB for the
    1 MiB chunks and what is kept), not the line's 32 MB."""
    import tracemalloc

    from msmodelslim.core.calib import CHARS_PER_TOKEN

    text = "a few words of calibration text " * 1_000_000
    index = make_set(tmp_path, [{"text": "short"}, {"text": text}, {"text": "after it"}])
    tracemalloc.start()
    try:
        records = load_calib_records(str(index), default_text="", max_seq_len=64)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [r.text for r in records] == ["short", text[:64 * CHARS_PER_TOKEN], "after it"]
    assert peak < 8 << 20, peak
