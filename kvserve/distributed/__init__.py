"""Tensor parallelism: how the model is cut across ranks (parallel.py), and the worker
processes that hold the other ranks (worker.py)."""
