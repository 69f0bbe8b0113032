"""The loading room: prepared datasets to resumable batches, tuned for this machine.

- `dataset`: format-agnostic dataset views (`open_dataset`, `MapDataset`, `StreamDataset`);
- `config`: `LoaderConfig` (what the batches are) and `WorkerSettings` (how fast they come);
- `order`: the sample order of an epoch per rank and worker, and its resumable state;
- `views`: the datasets a DataLoader's workers run (transform, batching, shard tags);
- `state`: the `Stateful` protocol every resumable part follows;
- `transforms`: decoders and the uint8 image transforms, `normalize` on the device;
- `jpeg_region`: a JPEG crop's region decoded alone (TurboJPEG 3, where installed);
- `threads`: the thread engine (each sample's transform on a pool of threads in this process);
- `device_decode`: ``decode="cuda"``, the batch decoded, cropped and resized on the GPU;
- `stages`: what runs between the DataLoader and the caller, built from the worker settings;
- `loader`: `make_loader` and `PreparedLoader`, the resumable DataLoader;
- `profile`: saved worker settings per dataset, machine and loader config;
- `tune`: `bench-loader`'s stage measurements and worker search;
- `verdicts`: what `bench-loader` says about them in plain words.

Nothing here is imported by `import dlpipe` until used: the public names are re-exported
lazily from `dlpipe`, and these modules import torch.
"""
