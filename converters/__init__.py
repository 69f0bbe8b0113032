"""Raw-dataset sources and the conversion engine, imported as ``dlpipe.converters``.

Each source is a short module over a shared base whose docstring states the raw layout it
expects; the engine plans shards deterministically and writes them in parallel with
`dlpipe.write_shard`.
"""
