"""Scripts the check runs as jobs and helpers, in the machine's own Python (PyTorch, JAX, TensorFlow)."""
