"""Scripts that ``tests/test_vllm.py`` runs in a fresh process (repository root on ``PYTHONPATH``)."""
