"""Parallel folding: the layout (dims.py), tensor (tensor.py), sequence split (sequence.py),
expert (expert.py) and data (data.py) parallelism, applied to a built model by `parallelize`."""
