"""moefold: PyTorch-native training of Mixture-of-Experts language models."""

__version__ = "0.1.0"
