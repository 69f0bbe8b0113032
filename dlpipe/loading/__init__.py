"""The loading room: prepared datasets to resumable batches, tuned for this machine.

- `dataset`: format-agnostic dataset views (`open_dataset`, `MapDataset`, `StreamDataset`);
- `order`: the sample order of an epoch per rank and worker, and its resumable state;
- `transforms`: decoders and the uint8 image transforms, `normalize` on the device;
- `loader`: `make_loader`, the resumable DataLoader;
- `profile`: saved worker settings per dataset, machine and loader config;
- `tune`: `bench-loader`'s stage measurements and worker search.

Nothing here is imported by `import dlpipe` until used: the public names are re-exported
lazily from `dlpipe`, and these modules import torch.
"""
