"""The bundled trainer, imported as ``dlpipe.train``: config, model factory, AMP + DDP loop,
checkpoints, metrics and logging, consuming datasets through `dlpipe.open_dataset`.
"""
