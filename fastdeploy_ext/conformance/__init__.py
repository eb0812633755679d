"""The conformance suite: one set of tests every runner must pass.

    pytest --pyargs fastdeploy_ext.conformance --fdx-backend NAME

NAME is any registered backend (built-in or out of tree). See DESIGN.md section 6 and README.
"""
