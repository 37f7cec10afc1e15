"""The benchmarks a user runs (README.md in this folder says which), importable by the tests."""
