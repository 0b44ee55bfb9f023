"""The experiment harness: the benchmark workloads and every `fxmem bench` experiment.

Apart from the core: nothing that ``torch.compile(backend="fxmem")`` imports imports this package.
"""
