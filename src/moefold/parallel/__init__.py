"""Parallel layouts: how the ranks of a job fold into attention and expert process groups."""
