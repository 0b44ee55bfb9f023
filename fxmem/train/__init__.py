"""Training-loop helpers that work with or without the fxmem backend."""
