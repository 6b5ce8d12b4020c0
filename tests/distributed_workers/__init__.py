"""Workers that ``tests/test_distributed.py`` launches under torchrun as modules
(``-m tests.distributed_workers.NAME``, repository root on ``PYTHONPATH``)."""
