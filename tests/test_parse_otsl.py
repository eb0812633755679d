"""OTSL -> HTML: goldens with row and column spans; malformed model output never raises."""
import re

import pytest
from hypothesis import given, settings, strategies as st

from fastdeploy_ext.parsing.otsl import otsl_to_html


@pytest.mark.parametrize("otsl,html", [
    ("<fcel>a<fcel>b<nl><fcel>c<fcel>d<nl>",
     "<table><tr><td>a</td><td>b</td></tr><tr><td>c</td><td>d</td></tr></table>"),
    # a header spanning two columns, an empty cell
    ("<fcel>Year<lcel><fcel>Total<nl><fcel>2023<fcel>Q1<ecel><nl>",
     '<table><tr><td colspan="2">Year</td><td>Total</td></tr><tr><td>2023</td><td>Q1</td><td></td></tr></table>'),
    # a cell spanning three rows
    ("<fcel>Group<fcel>x<nl><ucel><fcel>y<nl><ucel><fcel>z<nl>",
     '<table><tr><td rowspan="3">Group</td><td>x</td></tr><tr><td>y</td></tr><tr><td>z</td></tr></table>'),
    # a 2x2 block (ucel + xcel), and the wrapper/location tags the model may emit
    ("<otsl><loc_1><loc_2><fcel>A<lcel><fcel>B<nl><ucel><xcel><fcel>C<nl><fcel>d<fcel>e<fcel>f<nl></otsl>",
     '<table><tr><td rowspan="2" colspan="2">A</td><td>B</td></tr><tr><td>C</td></tr>'
     '<tr><td>d</td><td>e</td><td>f</td></tr></table>'),
    # no final <nl>; cell text is HTML-escaped and trimmed
    ("<fcel> a<b & c <fcel>2", "<table><tr><td>a&lt;b &amp; c</td><td>2</td></tr></table>"),
])
def test_goldens(otsl, html):
    assert otsl_to_html(otsl) == html


@pytest.mark.parametrize("otsl,html", [
    # span tokens with nothing to extend become plain cells (text kept)
    ("<lcel>x<ucel><nl>", "<table><tr><td>x</td><td></td></tr></table>"),
    # a ragged row is padded with empty cells
    ("<fcel>a<fcel>b<fcel>c<nl><fcel>d<nl>",
     "<table><tr><td>a</td><td>b</td><td>c</td></tr><tr><td>d</td><td></td><td></td></tr></table>"),
    # a row span broken by a wrong token in the spanned columns: no holes, the orphans are empty cells
    ("<fcel>A<lcel><nl><ucel><lcel><nl>",
     '<table><tr><td colspan="2">A</td></tr><tr><td></td><td></td></tr></table>'),
    ("<nl><nl>", "<table></table>"),
])
def test_malformed_input(otsl, html):
    assert otsl_to_html(otsl) == html


def test_text_without_otsl_tokens_is_returned_unchanged():
    assert otsl_to_html("<table><tr><td>1</td></tr></table>") == "<table><tr><td>1</td></tr></table>"
    assert otsl_to_html("") == ""


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["<fcel>", "<ecel>", "<lcel>", "<ucel>", "<xcel>", "<nl>", "x", " ", "<", "</otsl>"]),
                max_size=40))
def test_random_token_soup_never_raises_and_has_no_holes(tokens):
    out = otsl_to_html("".join(tokens))
    if out.startswith("<table>"):
        assert out.endswith("</table>")
        widths = row_widths(out)
        assert len(set(widths)) <= 1, (out, widths)        # every row covers the same columns


def row_widths(html):
    """Columns each row covers, counting cells spanning down from rows above."""
    rows = re.findall(r"<tr>(.*?)</tr>", html)
    carried = [0] * (len(rows) + 64)
    widths = []
    for i, row in enumerate(rows):
        w = carried[i]
        for attrs in re.findall(r"<td([^>]*)>", row):
            rs = int((re.search(r'rowspan="(\d+)"', attrs) or [0, 1])[1])
            cs = int((re.search(r'colspan="(\d+)"', attrs) or [0, 1])[1])
            w += cs
            for k in range(1, rs):
                carried[i + k] += cs
        widths.append(w)
    return widths


def test_row_widths_sees_a_hole():
    assert row_widths('<table><tr><td rowspan="2">a</td><td>b</td></tr><tr><td>c</td></tr></table>') == [2, 2]
    assert row_widths("<table><tr><td>a</td><td>b</td></tr><tr><td>c</td></tr></table>") == [2, 1]
