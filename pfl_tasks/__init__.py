"""pfl_tasks: the personalized-federated-learning library behind the pipeline.

Its layers, each importing only from its own and those below it, are drawn in docs/engine.md
("Layout") and held by tests/test_layers.py.
"""
