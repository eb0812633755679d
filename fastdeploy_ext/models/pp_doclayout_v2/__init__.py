"""PP-DocLayoutV2, the layout detector the original PaddleOCR-VL pairs with: a DetectorFamily (family.py)."""
