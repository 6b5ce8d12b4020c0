"""Adapters for training and rollout frameworks, importable as ``logra_optim.integrations.<name>``.

Each adapter depends on the core package and on its framework (an optional extra); the core never
imports from here.
"""
