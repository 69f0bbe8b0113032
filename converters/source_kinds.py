"""The registry of raw-dataset layouts: ``--source`` kind → the `Source` class that reads it.

It imports nothing, so the option that names a layout (`dlpipe.converters.source.SourceOptions`)
can list the kinds without importing the sources; `dlpipe.converters.sources` opens them.
"""

from __future__ import annotations

__all__ = ["SOURCE_KINDS"]

# kind -> "module:Class"; the most specific layouts first, the loosest (class folders) last
SOURCE_KINDS = {
    "cifar": "dlpipe.converters.cifar:CifarSource",
    "mnist": "dlpipe.converters.mnist:MnistSource",
    "webdataset": "dlpipe.converters.wds_source:WebDatasetSource",
    "food101": "dlpipe.converters.splitlist_datasets:Food101Source",
    "cub200": "dlpipe.converters.splitlist_datasets:Cub200Source",
    "oxford-pets": "dlpipe.converters.oxford_pets:OxfordPetsSource",
    "flowers102": "dlpipe.converters.splitlist_mat:Flowers102Source",
    "stanford-cars": "dlpipe.converters.splitlist_mat:StanfordCarsSource",
    "voc": "dlpipe.converters.voc:VocSource",
    "voc-seg": "dlpipe.converters.voc:VocSegmentationSource",
    "yolo": "dlpipe.converters.yolo:YoloSource",
    "coco": "dlpipe.converters.coco:CocoSource",
    "hf": "dlpipe.converters.hf_folder:HfFolderSource",
    "table": "dlpipe.converters.table:TableSource",
    "filenames": "dlpipe.converters.filenames:FilenamesSource",
    "splitlist": "dlpipe.converters.splitlist:SplitListSource",
    "files": "dlpipe.converters.files:FilesSource",
    "imagenet": "dlpipe.converters.imagenet:ImageNetSource",
    "imagefolder": "dlpipe.converters.imagefolder:ImageFolderSource",
}
