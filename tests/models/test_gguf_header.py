"""The lean GGUF header reader agrees with ``gguf.GGUFReader`` and refuses bad files."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from vlite.models.gguf_header import GGUFHeaderError, read_header


def _write(path, long_len=2000):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("test.u32", 7)
    writer.add_int64("test.i64", -5)
    writer.add_float32("test.f32", 0.25)
    writer.add_bool("test.flag", True)
    writer.add_string("test.name", "héllo")
    writer.add_array("test.short_ints", [1, 2, 3])
    writer.add_array("test.short_strings", ["a", "bc", ""])
    writer.add_array("test.long_strings", [f"token{i}" for i in range(long_len)])
    writer.add_array("test.long_floats", [float(i) for i in range(long_len)])
    writer.add_tensor("plain", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("half", np.arange(64, dtype=np.float16).reshape(2, 32))
    blocks = gguf.quants.quantize(
        np.linspace(-1, 1, 256, dtype=np.float32).reshape(4, 64), gguf.GGMLQuantizationType.Q8_0
    )
    writer.add_tensor("q8", blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _reference_metadata(reader, max_len):
    metadata = {}
    for key, field in reader.fields.items():
        is_array = field.types and field.types[0] == gguf.GGUFValueType.ARRAY
        if not (is_array and len(field.data) > max_len):
            metadata[key] = field.contents()
    return metadata


def test_metadata_and_tensors_equal_gguf_readers(tmp_path):
    path = _write(tmp_path / "t.gguf")
    header = read_header(path, max_array_len=1024)
    reader = gguf.GGUFReader(path)
    assert header.metadata == _reference_metadata(reader, 1024)
    assert header.metadata["test.name"] == "héllo" and header.metadata["test.flag"] is True
    assert header.skipped_arrays == {"test.long_strings": 2000, "test.long_floats": 2000}
    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(header.tensors, reader.tensors, strict=True):
        assert ours.tensor_type == theirs.tensor_type
        assert ours.shape.tolist() == theirs.shape.tolist()
        assert (ours.n_elements, ours.n_bytes) == (theirs.n_elements, theirs.n_bytes)
        assert ours.data_offset == theirs.data_offset
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
        assert np.array_equal(ours.data, theirs.data)


def test_a_longer_limit_keeps_the_long_arrays(tmp_path):
    path = _write(tmp_path / "t.gguf", long_len=50)
    header = read_header(path, max_array_len=1024)
    assert header.skipped_arrays == {}
    assert header.metadata["test.long_strings"][-1] == "token49"
    assert read_header(path, max_array_len=10).skipped_arrays == {
        "test.long_strings": 50,
        "test.long_floats": 50,
    }


def test_not_gguf_is_refused(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(GGUFHeaderError, match="no GGUF magic"):
        read_header(path)


def test_an_unsupported_version_is_refused(tmp_path):
    path = tmp_path / "v.gguf"
    path.write_bytes(b"GGUF" + (9).to_bytes(4, "little") + bytes(16))
    with pytest.raises(GGUFHeaderError, match="version 9"):
        read_header(path)


def test_a_truncated_header_is_refused_naming_where(tmp_path):
    whole = _write(tmp_path / "t.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:200])
    with pytest.raises(GGUFHeaderError, match="truncated|past the end"):
        read_header(cut)


def test_a_tensor_past_the_end_is_refused(tmp_path):
    whole = _write(tmp_path / "t.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:-64])  # the header intact, the last tensor's bytes short
    with pytest.raises(GGUFHeaderError, match="'q8'.*runs past the end"):
        read_header(cut)
