"""Tools built on the runtime: benchmark, tuning, costs, serving and infer.py's commands."""
