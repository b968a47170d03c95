"""Slurm deployment: the batch script and its Python helper."""
