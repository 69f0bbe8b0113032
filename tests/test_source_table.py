"""The ``table`` source: CSV/TSV/JSONL/Parquet rows, split files, columns, keys and errors."""

from __future__ import annotations

import datetime
import decimal
import io
import json
import pickle
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from dlpipe.converters.source import SampleError, SourceError, SourceOptions
from dlpipe.converters.table import TableSource, split_of_name


def image_bytes(index: int, fmt: str = "JPEG") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 6), (index * 40 % 256, 90, 200)).save(out, fmt)
    return out.getvalue()


def write_images(folder: Path, names: list[str]) -> None:
    for i, name in enumerate(names):
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(image_bytes(i, "PNG" if name.endswith(".png") else "JPEG"))


def write_text(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def write_parquet(
    path: Path, columns: dict, metadata: dict | None = None, row_group_size: int | None = None
) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table(columns)
    if metadata is not None:
        table = table.replace_schema_metadata({"huggingface": json.dumps(metadata)})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def scan(root: Path, **options: str):
    source = TableSource(str(root), SourceOptions(**options))
    return source, source.scan()


@pytest.fixture
def pets(tmp_path: Path) -> Path:
    write_images(tmp_path, ["images/cat1.jpg", "images/dog1.png", "images/cat2.jpg"])
    rows = "image,label\nimages/cat1.jpg,cat\nimages/dog1.png,dog\nimages/cat2.jpg,cat\n"
    return write_text(tmp_path / "labels.csv", rows)


def test_csv_with_relative_paths_and_string_labels(pets: Path) -> None:
    source, result = scan(pets)
    assert result.classes == ("cat", "dog")
    assert [it.label for it in result.items] == [0, 1, 0]
    assert [it.key for it in result.items] == ["row_00000000", "row_00000001", "row_00000002"]
    assert {it.split for it in result.items} == {None}
    assert [it.image_kind for it in result.items] == ["jpg", "png", "jpg"]
    first = result.items[0]
    assert first.origin == "labels.csv row 0 (images/cat1.jpg)"
    assert first.size == (pets.parent / "images/cat1.jpg").stat().st_size
    assert source.load(first) == {"image": (pets.parent / "images/cat1.jpg").read_bytes()}
    assert result.description["columns"]["image"] == "image"


def test_source_and_items_pickle_and_load_in_another_process_state(pets: Path) -> None:
    source, result = scan(pets)
    clone, item = pickle.loads(pickle.dumps((source, result.items[1])))
    assert clone.load(item)["image"] == (pets.parent / "images/dog1.png").read_bytes()


def test_tsv_and_absolute_paths(tmp_path: Path) -> None:
    write_images(tmp_path, ["sub/a.jpg", "b.jpg"])  # absolute paths inside the table's folder
    rows = f"filename\tclass\textra\n{tmp_path / 'sub/a.jpg'}\tx\t1\nb.jpg\ty\t2\n"
    source, result = scan(write_text(tmp_path / "sub/t.tsv", rows))
    assert result.classes == ("x", "y")
    assert source.load(result.items[0])["image"] == (tmp_path / "sub/a.jpg").read_bytes()
    with pytest.raises(SampleError, match=r"t\.tsv row 1 \(b\.jpg\).*sub/b\.jpg"):
        source.load(result.items[1])  # relative to the table's folder, not the cwd


def test_jsonl_with_integer_labels(tmp_path: Path) -> None:
    write_images(tmp_path, ["0.jpg", "1.jpg"])
    lines = [{"path": "0.jpg", "target": 2, "caption": "ünï"}, {"path": "1.jpg", "target": 0}]
    text = "\n".join(json.dumps(line) for line in lines)
    source, result = scan(write_text(tmp_path / "rows.jsonl", text))
    assert result.classes == ("0", "1", "2")
    assert [it.label for it in result.items] == [2, 0]
    loaded = source.load(result.items[0])
    assert loaded["json"] == '{"caption":"ünï"}'.encode()
    assert json.loads(source.load(result.items[1])["json"]) == {"caption": None}


def test_parquet_with_binary_image_column(tmp_path: Path) -> None:
    images = [image_bytes(i) for i in range(3)] + [image_bytes(3, "PNG")]
    path = write_parquet(tmp_path / "pets.parquet", {"picture": images, "y": [0, 1, 1, 3]})
    source, result = scan(path)  # the one binary column is the image
    assert result.classes == ("0", "1", "2", "3")
    assert [it.size for it in result.items] == [len(b) for b in images]
    assert [it.image_kind for it in result.items] == ["jpg", "jpg", "jpg", "png"]
    assert result.items[3].origin == "pets.parquet row 3"
    assert source.load(result.items[3]) == {"image": images[3]}


def test_parquet_hf_image_struct_and_classlabel(tmp_path: Path) -> None:
    write_images(tmp_path, ["disk.jpg"])
    embedded = image_bytes(7)
    image = pa.array(
        [{"bytes": embedded, "path": "ignored.jpg"}, {"bytes": None, "path": "disk.jpg"}],
        pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
    )
    features = {"label": {"_type": "ClassLabel", "names": ["airplane", "bird", "cat"]}}
    path = write_parquet(
        tmp_path / "cifar.parquet",
        {"image": image, "label": [1, 0]},
        metadata={"info": {"features": features}},
    )
    source, result = scan(path)
    assert result.classes == ("airplane", "bird", "cat")
    assert [it.label for it in result.items] == [1, 0]
    assert result.items[0].size == len(embedded)
    assert result.items[1].origin == "cifar.parquet row 1 (disk.jpg)"
    assert source.load(result.items[0]) == {"image": embedded}
    assert source.load(result.items[1]) == {"image": (tmp_path / "disk.jpg").read_bytes()}


def test_split_files(tmp_path: Path) -> None:
    write_images(tmp_path, ["a.jpg", "b.jpg", "c.jpg"])
    write_text(tmp_path / "train.csv", "file,label\na.jpg,1\nb.jpg,0\n")
    write_text(tmp_path / "validation.csv", "file,label\nc.jpg,1\n")
    assert not TableSource.detect(str(tmp_path))  # images beside: only with --source table
    _, result = scan(tmp_path)
    assert [(it.split, it.key) for it in result.items] == [
        ("train", "train_00000000"),
        ("train", "train_00000001"),
        ("val", "val_00000000"),
    ]
    assert result.items[2].origin == "validation.csv row 0 (c.jpg)"


def test_hugging_face_data_folder(tmp_path: Path) -> None:
    images = [image_bytes(i) for i in range(5)]
    data = tmp_path / "data"
    second = {"image": images[2:4], "label": [1, 1]}
    write_parquet(data / "train-00001-of-00002.parquet", second, row_group_size=1)
    write_parquet(data / "train-00000-of-00002.parquet", {"image": images[:2], "label": [0, 1]})
    write_parquet(data / "test-00000-of-00001.parquet", {"image": images[4:], "label": [0]})
    write_text(tmp_path / "README.md", "# a dataset card\n")
    assert TableSource.detect(str(tmp_path))
    source, result = scan(tmp_path)
    train = [it for it in result.items if it.split == "train"]
    assert [it.key for it in train] == [f"train_{i:08d}" for i in range(4)]
    assert [source.load(it)["image"] for it in train] == images[:4]  # sorted name order
    assert [it.split for it in result.items].count("test") == 1
    assert train[2].origin == "data/train-00001-of-00002.parquet row 0"


def test_split_column(tmp_path: Path) -> None:
    write_images(tmp_path, ["a.jpg", "b.jpg", "c.jpg", "d.jpg"])
    rows = "image,label,split\na.jpg,0,train\nb.jpg,1,validation\nc.jpg,0,TEST\nd.jpg,1,train\n"
    source, result = scan(write_text(tmp_path / "all.csv", rows))
    assert [(it.split, it.key) for it in result.items] == [
        ("train", "train_00000000"),
        ("val", "val_00000000"),
        ("test", "test_00000000"),
        ("train", "train_00000001"),
    ]
    assert "json" not in source.load(result.items[0])  # the split column is not data


def test_bad_split_value(tmp_path: Path) -> None:
    write_text(tmp_path / "all.csv", "image,split\na.jpg,train\nb.jpg,holdout\n")
    with pytest.raises(SourceError, match=r"all\.csv row 1: split 'holdout'.*rename"):
        scan(tmp_path / "all.csv")


def test_extra_columns_become_json(tmp_path: Path) -> None:
    path = write_parquet(
        tmp_path / "t.parquet",
        {
            "image": [image_bytes(0)],
            "label": ["cat"],
            "when": [datetime.date(2024, 5, 1)],
            "price": pa.array([decimal.Decimal("1.50")], pa.decimal128(5, 2)),
            "score": [float("nan")],
            "blob": [b"\x00\x01"],
            "tags": [["a", "b"]],
            "meta": [{"w": 8, "h": 6}],
        },
    )
    source, _ = scan(path)
    text = source.load(source.scan().items[0])["json"]
    assert text == (
        b'{"blob":"AAE=","meta":{"h":6,"w":8},"price":"1.50","score":null,'
        b'"tags":["a","b"],"when":"2024-05-01"}'
    )
    assert source.scan().description["columns"]["json"] == [
        "blob", "meta", "price", "score", "tags", "when"
    ]  # fmt: skip


def test_explicit_columns(tmp_path: Path) -> None:
    write_images(tmp_path, ["a.jpg", "b.jpg"])
    rows = "photo,species,label\na.jpg,cat,9\nb.jpg,dog,9\n"
    source, result = scan(
        write_text(tmp_path / "t.csv", rows), image_col="photo", label_col="species"
    )
    assert result.classes == ("cat", "dog")
    assert source.load(result.items[1]) == {
        "image": (tmp_path / "b.jpg").read_bytes(),
        "json": b'{"label":9}',
    }


@pytest.mark.parametrize(
    ("option", "flag"), [("image_col", "--image-col"), ("label_col", "--label-col")]
)
def test_missing_given_column(pets: Path, option: str, flag: str) -> None:
    with pytest.raises(SourceError, match=rf"labels\.csv: {flag} 'pic' .*columns are image, label"):
        scan(pets, **{option: "pic"})


def test_no_image_column(tmp_path: Path) -> None:
    write_text(tmp_path / "t.csv", "name,label\na,1\n")
    with pytest.raises(SourceError, match=r"t\.csv: no image column.*name, label.*--image-col"):
        scan(tmp_path / "t.csv")


@pytest.mark.parametrize("text", ["", "image,label\n"])
def test_empty_table(tmp_path: Path, text: str) -> None:
    write_text(tmp_path / "t.csv", text)
    with pytest.raises(SourceError, match=r"t\.csv.*empty|t\.csv: the table has no rows"):
        scan(tmp_path / "t.csv")


def test_unparseable_file(tmp_path: Path) -> None:
    (tmp_path / "train.parquet").write_bytes(b"not a parquet file at all")
    with pytest.raises(SourceError, match=r"train\.parquet: cannot be read as parquet"):
        scan(tmp_path)


def test_missing_image_fails_at_load(pets: Path) -> None:
    (pets.parent / "images/dog1.png").unlink()
    source, result = scan(pets)
    assert result.items[1].size == 0
    with pytest.raises(SampleError, match=r"labels\.csv row 1 \(images/dog1\.png\).*dog1\.png"):
        source.load(result.items[1])


def test_id_column_keys(tmp_path: Path) -> None:
    write_images(tmp_path, ["a.jpg", "b.jpg"])
    source, result = scan(write_text(tmp_path / "t.csv", "id,image\ncats/001,a.jpg\n7,b.jpg\n"))
    assert [it.key for it in result.items] == ["cats%2F001", "7"]
    assert source.load(result.items[0])["json"] == b'{"id":"cats/001"}'


def test_duplicate_ids(tmp_path: Path) -> None:
    write_text(tmp_path / "t.csv", "id,image\nx,a.jpg\ny,b.jpg\nx,c.jpg\n")
    with pytest.raises(SourceError, match=r"row 2: key 'x' in column 'id' is a duplicate"):
        scan(tmp_path / "t.csv")


def test_tables_must_agree(tmp_path: Path) -> None:
    write_text(tmp_path / "train.csv", "image,label\na.jpg,1\n")
    write_text(tmp_path / "test.csv", "image,label,note\nb.jpg,0,hi\n")
    with pytest.raises(SourceError, match="different columns"):
        scan(tmp_path)
    write_text(tmp_path / "extra.csv", "image,label\nc.jpg,1\n")
    with pytest.raises(SourceError, match=r"extra\.csv name no split"):
        scan(tmp_path)


def test_detect(tmp_path: Path, pets: Path) -> None:
    assert TableSource.detect(str(pets))
    assert TableSource.detect(str(tmp_path))  # one image+label table beside its images folder
    assert TableSource.detect(str(write_text(tmp_path / "only/rows.jsonl", "{}\n").parent))
    assert TableSource.detect(str(write_text(tmp_path / "x.NDJSON", "{}\n")))
    assert not TableSource.detect(str(tmp_path / "images"))
    assert not TableSource.detect(str(tmp_path / "images/cat1.jpg"))
    (tmp_path / "empty").mkdir()
    assert not TableSource.detect(str(tmp_path / "empty"))
    write_text(tmp_path / "doc/README.md", "no tables here")
    assert not TableSource.detect(str(tmp_path / "doc"))


def test_split_of_name() -> None:
    assert split_of_name("data/train-00000-of-00002.parquet") == "train"
    assert split_of_name("validation.csv") == "val"
    assert split_of_name("val_part1.jsonl") == "val"
    assert split_of_name("test.tsv") == "test"
    assert split_of_name("training_notes.csv") is None
    assert split_of_name("labels.csv") is None
