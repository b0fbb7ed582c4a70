"""The PyTorch executor of a Program (installed as `pipec.runtime`); the only part that imports torch."""
