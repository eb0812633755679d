"""Document parsing: PDFs and page images -> Markdown and PaddleX-shaped JSON."""
