"""The Python side of the Slurm launch: `slurm.step_launcher`, which submit.py's jobs import.

A regular package (not a namespace one), so that no other `slurm` folder on sys.path, such as
tests/slurm/, can shadow it."""
