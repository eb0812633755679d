"""OTSL (the VLM's table output) -> HTML with row and column spans.

OTSL writes a table as a grid, one token per cell, rows ended by ``<nl>``: ``<fcel>`` a cell with
its text after the token, ``<ecel>`` an empty cell, ``<lcel>`` part of the cell to its left
(column span), ``<ucel>`` part of the cell above (row span), ``<xcel>`` part of both (a cell
spanning rows and columns). A cell's colspan is 1 + the ``<lcel>`` run to its right in its row;
its rowspan 1 + the run of rows whose token in its column is ``<ucel>`` (or ``<xcel>`` for a
cell spanning columns too).

Model output is not always well formed: text before the first token, a span token with nothing
to extend (first row or column), ragged rows, a missing final ``<nl>`` or a truncated tail. None
of it raises: an orphan span token becomes an empty cell, short rows are padded with empty
cells, and text with no OTSL token at all is returned unchanged (the model may answer in HTML).
"""
from __future__ import annotations

import html
import re

CELL_TOKENS = ("fcel", "ecel", "lcel", "ucel", "xcel")
_TOKEN = re.compile(r"<(fcel|ecel|lcel|ucel|xcel|nl)>")
_WRAPPER = re.compile(r"</?otsl>|<loc_\d+>|</?has_tbody>|</?tbody>")


def parse_otsl(text: str) -> list[list[tuple[str, str]]]:
    """The grid: rows of (token, text) cells, empty rows dropped."""
    body = _WRAPPER.sub("", text)
    parts = _TOKEN.split(body)
    rows: list[list[tuple[str, str]]] = [[]]
    # parts: [text before the first token, token, text, token, text, ...]
    for k in range(1, len(parts), 2):
        tok, cell_text = parts[k], parts[k + 1].strip()
        if tok == "nl":
            rows.append([])
        else:
            rows[-1].append((tok, cell_text))
    return [r for r in rows if r]


def _normalise(grid: list[list[tuple[str, str]]]) -> list[list[tuple[str, str]]]:
    """Rectangular, with every span token extending something."""
    width = max((len(r) for r in grid), default=0)
    out = [list(r) + [("ecel", "")] * (width - len(r)) for r in grid]
    for i, row in enumerate(out):
        for j, (tok, txt) in enumerate(row):
            left = out[i][j - 1][0] if j > 0 else None
            up = out[i - 1][j][0] if i > 0 else None
            alone = ("fcel" if txt else "ecel", txt)      # an orphan span token with text keeps it
            if tok == "lcel" and left is None:
                row[j] = alone
            elif tok == "ucel" and up is None:
                row[j] = alone
            elif tok == "xcel" and (left is None or up is None):
                row[j] = ("lcel", txt) if left is not None else ("ucel", txt) if up is not None else alone
    return out


def otsl_to_html(text: str) -> str:
    """OTSL -> ``<table>...</table>``; text without OTSL tokens unchanged."""
    if not _TOKEN.search(text):
        return text
    grid = _normalise(parse_otsl(text))
    if not grid:
        return "<table></table>"
    n_rows, n_cols = len(grid), len(grid[0])
    covered: set[tuple[int, int]] = set()
    out = ["<table>"]
    for i in range(n_rows):
        out.append("<tr>")
        for j in range(n_cols):
            if (i, j) in covered:
                continue
            tok, txt = grid[i][j]
            colspan = rowspan = 1
            if tok in ("fcel", "ecel"):
                while (j + colspan < n_cols and grid[i][j + colspan][0] == "lcel"
                       and (i, j + colspan) not in covered):
                    colspan += 1
                while i + rowspan < n_rows and _extends_down(grid[i + rowspan], j, colspan):
                    rowspan += 1
            # else: a span token no cell claimed (a malformed grid): an empty cell, no hole
            covered.update((r, c) for r in range(i, i + rowspan) for c in range(j, j + colspan))
            attrs = (f' rowspan="{rowspan}"' if rowspan > 1 else "") + (f' colspan="{colspan}"' if colspan > 1 else "")
            out.append(f"<td{attrs}>{html.escape(txt, quote=False) if tok == 'fcel' else ''}</td>")
        out.append("</tr>")
    out.append("</table>")
    return "".join(out)


def _extends_down(row: list[tuple[str, str]], j: int, colspan: int) -> bool:
    """Whether ``row`` continues the cell spanning columns j..j+colspan-1 from the row above."""
    return row[j][0] == "ucel" and all(row[c][0] == "xcel" for c in range(j + 1, j + colspan))
