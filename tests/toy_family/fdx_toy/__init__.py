"""toy_vlm: a tiny VLM with 1D rope and a fixed-size patch encoder (a fastdeploy_ext model family)."""
