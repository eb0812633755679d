"""PP-DocLayoutV3, the layout detector: a DetectorFamily (family.py)."""
