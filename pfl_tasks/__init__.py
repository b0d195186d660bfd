"""pfl_tasks: the personalized-federated-learning library behind the pipeline.

Layers, each importing only from those before it:
data -> nets -> engine -> algorithms -> tracking. `config` holds the typed params for all.
"""
