"""The checks of a COCO instances file and of ``boxes.json`` take a short way for values as COCO
writes them; any other value goes the full way, so the objects kept, the problems named and the
bytes written are those of the full checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dlpipe.annotations import AnnotationError, check_boxes, encode_boxes, read_boxes
from dlpipe.converters.coco_json import read_instances
from dlpipe.converters.source import SourceError

_XYWH = " [x, y, width, height]"


def _instances(tmp_path: Path, annotations: list[dict[str, Any]]) -> Path:
    path = tmp_path / "instances.json"
    images = [{"id": 1, "file_name": "a.jpg", "width": 64, "height": 48}]
    categories = [{"id": 3, "name": "cat"}]
    path.write_text(
        json.dumps({"images": images, "annotations": annotations, "categories": categories})
    )
    return path


def _annotation(**values: Any) -> dict[str, Any]:
    return {"id": 7, "image_id": 1, "category_id": 3, "bbox": [1, 2, 3, 4], "iscrowd": 0} | values


@pytest.mark.parametrize(
    ("values", "kept"),
    [
        ({}, (7, 3, 1, 2, 3, 4, 0)),
        ({"id": "a7", "bbox": [0.5, 1.25, 2.5, 3.0]}, ("a7", 3, 0.5, 1.25, 2.5, 3.0, 0)),
        ({"iscrowd": True}, (7, 3, 1, 2, 3, 4, 1)),  # JSON's true is a crowd flag of 1
        ({"iscrowd": 1, "segmentation": {"counts": [1], "size": [1, 1]}}, (7, 3, 1, 2, 3, 4, 1)),
        (
            {"bbox": [1, 2, 3, 0]},
            "annotations[0] (id 7): 'bbox' [1, 2, 3, 0] has no positive width and height",
        ),
        (
            {"bbox": [1, 2, 3, True]},
            "annotations[0] (id 7): 'bbox' [1, 2, 3, True] is not 4 numbers" + _XYWH,
        ),
        ({"bbox": [1, 2, 3]}, "annotations[0] (id 7): 'bbox' [1, 2, 3] is not 4 numbers" + _XYWH),
        ({"iscrowd": 2}, "annotations[0] (id 7): 'iscrowd' 2 is not 0 or 1"),
        ({"iscrowd": 1.0}, "annotations[0] (id 7): 'iscrowd' 1.0 is not 0 or 1"),
        ({"category_id": 3.0}, "annotations[0] (id 7): 'category_id' 3.0 is not an integer"),
        ({"id": None}, "annotations[0] (id None): has no integer or string 'id'"),
    ],
)
def test_an_annotation_keeps_its_object_or_names_its_problem(
    tmp_path: Path, values: dict[str, Any], kept: tuple[Any, ...] | str
) -> None:
    path = _instances(tmp_path, [_annotation(**values)])
    (found,) = read_instances(str(path), str(tmp_path)).objects[1]
    if isinstance(kept, str):
        assert found == f"{path}: {kept}"
    else:
        assert found == kept and type(found[-1]) is int


@pytest.mark.parametrize(
    "entry",
    [True, {"image_id": 1.5}, {"image_id": None}],
    ids=["not-an-object", "float-image-id", "no-image-id"],
)
def test_an_annotation_without_an_image_id_refuses_the_file(tmp_path: Path, entry: Any) -> None:
    path = _instances(tmp_path, [entry])
    with pytest.raises(SourceError, match=r"annotations\[0\]"):
        read_instances(str(path), str(tmp_path))


@pytest.mark.parametrize(
    ("value", "rule"),
    [
        ("[[1, 2, 1e999]]", "a list holding a number that is not finite"),
        ("[[1, 2], [3, -Infinity]]", "a list holding a number that is not finite"),
        ('["a", 10000000000000000000]', "the number 10000000000000000000 is not finite"),
        ('[{"a": NaN}]', "the number nan is not finite"),
        ('{"counts": [1, 9223372036854775808], "size": [1, 1]}', "a list holding a number"),
        ("[" * 15 + "]" * 15, "nesting deeper than 16 levels"),
    ],
)
def test_a_number_out_of_range_anywhere_in_an_annotation_refuses_the_file(
    tmp_path: Path, value: str, rule: str
) -> None:
    path = _instances(tmp_path, [_annotation(segmentation=None)])
    path.write_text(path.read_text().replace('"segmentation": null', f'"segmentation": {value}'))
    with pytest.raises(SourceError, match=rule):
        read_instances(str(path), str(tmp_path))


def test_deep_but_allowed_nesting_and_large_numbers_in_range_are_read(tmp_path: Path) -> None:
    path = _instances(tmp_path, [_annotation(segmentation=None)])
    value = "[" * 13 + "9223372036854775807, -1e18" + "]" * 13
    path.write_text(path.read_text().replace('"segmentation": null', f'"segmentation": {value}'))
    assert read_instances(str(path), str(tmp_path)).objects[1] == [(7, 3, 1, 2, 3, 4, 0)]


def test_encoded_boxes_are_the_same_bytes() -> None:
    data = encode_boxes(
        [[-0.0, 2.0**53, 0.1 + 0.2, 5], [1e16, 3, 7.5, 2**53 + 1]],
        [True, 2],
        iscrowd=[0, 1],
        ids=["a", 9],
        truncated=[1, 0],
    )
    assert data == (
        b'{"boxes":[[0,9007199254740992.0,0.30000000000000004,5],[1e+16,3,7.5,'
        b'9007199254740992.0]],"ids":["a",9],"iscrowd":[0,1],"labels":[1,2],"truncated":[1,0]}'
    )


@pytest.mark.parametrize(
    ("record", "rule"),
    [
        ({"boxes": [[0, 0, 1, 1], [0, 0, 1]], "labels": [0, 0]}, r"box \[0, 0, 1\] is not 4"),
        ({"boxes": [[0, 0, 1, 1], [0, 0, 1, True]], "labels": [0, 0]}, r"\[0, 0, 1, True\]"),
        ({"boxes": [[0, 0, 1, 1], [0, 0, 1, "1"]], "labels": [0, 0]}, r"\[0, 0, 1, '1'\]"),
        ({"boxes": [[0, 0, 1, 1], [0, 0, 1, 1]], "labels": [0, True]}, "class indices"),
        ({"boxes": [[0, 0, 1, 1]], "labels": [0], "difficult": [True]}, '"difficult" holds'),
        ({"boxes": [[0, 0, 1, 1]], "labels": [0], "iscrowd": [-1]}, '"iscrowd" holds'),
    ],
)
def test_the_first_bad_value_of_boxes_json_is_named(record: dict[str, Any], rule: str) -> None:
    with pytest.raises(AnnotationError, match=rule):
        read_boxes(json.dumps(record).encode())


def test_finite_boxes_whose_sum_overflows_are_read_and_checked() -> None:
    data = b'{"boxes": [[0, 0, 1e308, 1e308]], "labels": [0], "iscrowd": [0]}'
    assert read_boxes(data)["boxes"] == [[0, 0, 1e308, 1e308]]
    with pytest.raises(AnnotationError, match=r"object 0: box \[0, 0, 1e\+308, 1e\+308\] lies"):
        check_boxes(data, 64, 48)
