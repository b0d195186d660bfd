"""Engine layer: stacked client state, functional optimizers, the vectorized and sequential
executors, evaluation and checkpoints."""
