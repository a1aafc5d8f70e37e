"""Tensor parallelism: how the model is cut across ranks and the collectives between them
(parallel.py). The rank processes themselves are worker/tp_workers.py."""
