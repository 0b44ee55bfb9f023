"""fxmem's version, apart from the package's __init__: a module that reports it imports no more than this."""

__version__ = "0.1.0"
