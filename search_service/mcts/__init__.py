"""Monte Carlo tree search: backend interface, trees, the NumPy reference, Philox."""
