"""The experiment harness: the benchmark workloads and every `fxmem bench` experiment.

It lives in the repository beside the fxmem package and is not installed with it (as torchtune keeps its recipes
apart from its library): an experiment is run from a clone (`make demo`, `python -m fxmem bench ...`), and nothing of
fxmem imports it (tests/test_architecture.py); the `fxmem` command finds it by name (fxmem/cli/harness.py).
"""
