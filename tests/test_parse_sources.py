"""Inputs of `parse`: files, folders, globs and @lists expanded; page ranges; digests; page counts."""
import hashlib

import numpy as np
import pytest
from PIL import Image

from fastdeploy_ext.parsing.errors import PageError
from fastdeploy_ext.parsing.sources import count_pages, expand_inputs, file_digest, parse_page_ranges


@pytest.fixture
def tree(tmp_path):
    for rel in ("a.pdf", "b.PNG", "notes.txt", "sub/c.jpg", "sub/deeper/d.tiff", "sub/e.webp", "z/f.bmp",
                "._a.pdf", ".cache/g.png"):
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x")
    return tmp_path


def rel(paths, root):
    return [p.resolve().relative_to(root.resolve()).as_posix() for p in paths]


def test_folder_is_recursive_sorted_and_keeps_supported_suffixes(tree):
    # hidden files and folders are left out; named explicitly they are taken
    assert rel(expand_inputs([str(tree / "._a.pdf"), str(tree / ".cache")]), tree) == ["._a.pdf", ".cache/g.png"]
    assert rel(expand_inputs([str(tree)]), tree) == ["a.pdf", "b.PNG", "sub/c.jpg", "sub/deeper/d.tiff",
                                                    "sub/e.webp", "z/f.bmp"]


def test_globs_files_and_duplicates(tree):
    got = expand_inputs([str(tree / "sub" / "*"), str(tree / "a.pdf"), str(tree / "sub" / "c.jpg"),
                         str(tree / "." / "a.pdf")])
    # the glob matches c.jpg, the deeper folder (expanded) and e.webp; repeats are dropped
    assert rel(got, tree) == ["sub/c.jpg", "sub/deeper/d.tiff", "sub/e.webp", "a.pdf"]
    assert rel(expand_inputs([str(tree / "**" / "*.jpg")]), tree) == ["sub/c.jpg"]


def test_list_file_relative_to_its_folder_with_comments(tree):
    lst = tree / "sub" / "list.txt"
    lst.write_text("# inputs\nc.jpg\n\n  ../a.pdf  \n#../b.PNG\ndeeper\n")
    assert rel(expand_inputs([f"@{lst}"]), tree) == ["sub/c.jpg", "a.pdf", "sub/deeper/d.tiff"]


def test_bad_inputs_name_the_input(tree):
    with pytest.raises(ValueError, match=r"notes\.txt: unsupported file type '\.txt'"):
        expand_inputs([str(tree / "notes.txt")])
    with pytest.raises(ValueError, match=r"missing\.pdf: no such file or folder"):
        expand_inputs([str(tree / "a.pdf"), str(tree / "missing.pdf")])
    with pytest.raises(ValueError, match=r"nothing\*: the pattern matches no supported file"):
        expand_inputs([str(tree / "nothing*")])
    with pytest.raises(ValueError, match=r"@.*nolist\.txt: file not found"):
        expand_inputs([f"@{tree / 'nolist.txt'}"])
    lst = tree / "bad.txt"
    lst.write_text("a.pdf\nghost.png\n")
    with pytest.raises(ValueError, match=r"ghost\.png: no such file"):
        expand_inputs([f"@{lst}"])
    loop = tree / "loop.txt"
    loop.write_text(f"@{loop}\n")
    with pytest.raises(ValueError, match="includes itself"):
        expand_inputs([f"@{loop}"])
    with pytest.raises(ValueError, match="no inputs"):
        expand_inputs([])


@pytest.mark.parametrize("text,count,expect", [
    (None, 4, [0, 1, 2, 3]),
    ("", 3, [0, 1, 2]),
    ("all", 2, [0, 1]),
    ("1-3,7", 10, [0, 1, 2, 6]),
    ("5-", 7, [4, 5, 6]),
    ("2", 5, [1]),
    (" 2 , 1-2 ", 5, [0, 1]),
    ("9-", 3, []),
])
def test_page_ranges(text, count, expect):
    r = parse_page_ranges(text)
    assert r.select(count) == expect
    assert [i for i in range(count) if r.contains(i)] == expect


@pytest.mark.parametrize("bad", ["0", "3-1", "a", "1-2-3", "-4", "1,,2"])
def test_bad_page_ranges(bad):
    with pytest.raises(ValueError, match="--pages"):
        parse_page_ranges(bad)


def test_page_ranges_str():
    assert str(parse_page_ranges("1-3,7,9-")) == "1-3,7,9-"
    assert str(parse_page_ranges(None)) == "all"


def test_file_digest_is_sha256_streamed(tmp_path):
    p = tmp_path / "f.bin"
    data = np.random.default_rng(0).bytes(3 * 1024 + 17)
    p.write_bytes(data)
    assert file_digest(p, chunk=1024) == hashlib.sha256(data).hexdigest()


def test_count_pages(tmp_path):
    import pypdfium2 as pdfium
    pdf = pdfium.PdfDocument.new()
    for _ in range(3):
        pdf.new_page(100, 100).close()
    pdf.save(str(tmp_path / "three.pdf"))
    pdf.close()
    assert count_pages(tmp_path / "three.pdf") == 3
    frames = [Image.new("RGB", (20, 10), (i * 60, 0, 0)) for i in range(4)]
    frames[0].save(tmp_path / "four.tif", save_all=True, append_images=frames[1:])
    assert count_pages(tmp_path / "four.tif") == 4
    frames[0].save(tmp_path / "one.png")
    assert count_pages(tmp_path / "one.png") == 1


def test_count_pages_errors(tmp_path):
    (tmp_path / "empty.pdf").write_bytes(b"")
    (tmp_path / "junk.pdf").write_bytes(b"this is not a pdf at all")
    (tmp_path / "junk.png").write_bytes(b"this is not a png either")
    (tmp_path / "empty.tif").write_bytes(b"")
    for name, msg in (("empty.pdf", "file is empty"), ("junk.pdf", r"not a PDF \(no %PDF- header\)"),
                      ("nothere.pdf", "file not found"), ("empty.tif", "file is empty"),
                      ("junk.png", r"not a recognised image format \(corrupt or not an image\)")):
        with pytest.raises(PageError, match=msg) as e:
            count_pages(tmp_path / name)
        assert e.value.stage == "input" and str(e.value).startswith("input: ")
