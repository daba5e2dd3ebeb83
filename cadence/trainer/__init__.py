"""The training loop; knows nothing of processes."""
