"""The sample model and codecs: key rules, field names, decoding by extension, no pickle."""

from __future__ import annotations

import io
import pickle

import numpy as np
import pytest
from PIL import Image

import dlpipe
from dlpipe.sample import sample_fields


@pytest.mark.parametrize("key", ["a", "cat_0001", "x-y_Z9", "a%2Eb", "k" * 200])
def test_valid_keys_pass(key: str) -> None:
    assert dlpipe.check_key(key) == key


@pytest.mark.parametrize(
    "key", ["", "a.b", "a/b", "../etc", "/abs", "sp ace", "k" * 201, "bad%2e", "%zz", 3]
)
def test_keys_that_would_break_a_tar_name_are_rejected(key: object) -> None:
    with pytest.raises(dlpipe.InvalidKeyError, match="sample key"):
        dlpipe.check_key(key)


@pytest.mark.parametrize("text", ["cats/img.001", "../../etc/passwd", "ünï code", "a%b", "plain"])
def test_escape_key_gives_a_valid_key_that_unescapes_back(text: str) -> None:
    key = dlpipe.escape_key(text)
    assert dlpipe.check_key(key) == key
    assert "." not in key and "/" not in key
    assert dlpipe.unescape_key(key) == text


def test_escape_rule_is_percent_hex_of_utf8_bytes() -> None:
    assert dlpipe.escape_key("cats/img.001") == "cats%2Fimg%2E001"


@pytest.mark.parametrize("name", ["JPG", "__meta__", ".jpg", "a..b", "a/b", "a b", ""])
def test_bad_field_names_are_rejected(name: str) -> None:
    with pytest.raises(dlpipe.InvalidFieldError, match="field name"):
        sample_fields({"__key__": "k", name: b"x"})


@pytest.mark.parametrize("value", [b"03", b"3\n", b" 3", b"three", b"+3", b""])
def test_cls_must_be_canonical_ascii_decimal(value: bytes) -> None:
    with pytest.raises(dlpipe.InvalidFieldError, match="canonical"):
        sample_fields({"__key__": "k", "cls": value})


def test_sample_needs_a_key_bytes_values_and_a_field() -> None:
    with pytest.raises(dlpipe.InvalidKeyError, match="__key__"):
        sample_fields({"jpg": b"x"})
    with pytest.raises(dlpipe.InvalidFieldError, match="encode_field"):
        sample_fields({"__key__": "k", "txt": "not bytes"})
    with pytest.raises(dlpipe.InvalidFieldError, match="no fields"):
        sample_fields({"__key__": "k"})


def test_decode_by_extension(samples: list[dict]) -> None:
    decoded = dlpipe.decode_sample(samples[3])
    assert decoded["__key__"] == samples[3]["__key__"]
    assert isinstance(decoded["jpg"], Image.Image) and decoded["jpg"].mode == "RGB"
    assert decoded["png"].size == (16, 12)
    assert decoded["cls"] == 3
    assert decoded["txt"] == "sample 3: ünïcode"
    assert decoded["json"] == {"i": 3, "tags": ["a", "b"][:0]}
    np.testing.assert_array_equal(decoded["npy"], np.arange(4, dtype=np.float32) * 3)
    assert dlpipe.decode_field("seg.png", samples[0]["png"]).size == (16, 12)
    assert dlpipe.decode_field("bin", b"\x00\x01") == b"\x00\x01"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("jpg", "image"),
        ("jpeg", "image"),
        ("webp", "image"),
        ("seg.png", "image"),
        ("cls", "int"),
        ("txt", "text"),
        ("json", "json"),
        ("npy", "ndarray"),
        ("bin", "bytes"),
    ],
)
def test_field_types(name: str, expected: str) -> None:
    assert dlpipe.field_type(name) == expected


def test_encode_field_round_trips_each_type() -> None:
    image = Image.new("RGB", (5, 4), (10, 20, 30))
    for name, value in [
        ("cls", 7),
        ("txt", "héllo"),
        ("json", {"a": [1, 2]}),
        ("npy", np.eye(2, dtype=np.int16)),
        ("png", image),
    ]:
        decoded = dlpipe.decode_field(name, dlpipe.encode_field(name, value))
        if name == "npy":
            np.testing.assert_array_equal(decoded, value)
        elif name == "png":
            assert decoded.tobytes() == image.tobytes()
        else:
            assert decoded == value
    with pytest.raises(dlpipe.InvalidFieldError, match="cannot store"):
        dlpipe.encode_field("cls", "seven")


def test_npy_pickle_payload_is_refused_not_executed(tmp_path) -> None:
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    buffer = io.BytesIO()
    np.save(buffer, np.array([Exploit()], dtype=object), allow_pickle=True)
    with pytest.raises(dlpipe.FieldDecodeError, match="does not decode as ndarray"):
        dlpipe.decode_field("npy", buffer.getvalue())
    with pytest.raises(dlpipe.InvalidFieldError, match="pickle"):
        dlpipe.encode_field("npy", np.array([None], dtype=object))
    assert not marker.exists()
    # a raw pickle where a json/txt/cls value belongs is an error, never unpickled
    for name in ("json", "cls", "txt"):
        with pytest.raises(dlpipe.FieldDecodeError):
            dlpipe.decode_field(name, pickle.dumps(Exploit()))
    assert not marker.exists()


def test_broken_image_names_the_field() -> None:
    with pytest.raises(dlpipe.FieldDecodeError, match="'jpg'.*image"):
        dlpipe.decode_sample({"__key__": "k", "jpg": b"\xff\xd8 not really"})
