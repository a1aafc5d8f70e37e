"""Scheduling: which requests run in the next step and how much of each (scheduler), and the
step cost model and latency targets that size steps and admissions (slo)."""
