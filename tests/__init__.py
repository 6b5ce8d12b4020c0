"""The test suite, a package so that its helpers import as ``tests.helpers.*`` (run pytest from the
repository root; subprocess workers are launched with the root on ``PYTHONPATH``)."""
