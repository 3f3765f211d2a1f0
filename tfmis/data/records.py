"""The tfmis TFRecord format and its readers.

A converted dataset folder holds:
```
OUT/
  index.json            schema version, preprocessing parameters, splits → shards → record counts,
                        per-case metadata (geometry to undo preprocessing, byte offsets), skipped cases
  fingerprint.json      per-case shape/spacing/intensity/class statistics and dataset summary
  train-000-of-004.tfrecord.gz ...
```
Each record is a `tf.train.Example` holding one case: the image as raw little-endian bytes
(float16/float32, shape (x, y, z, C) in RAS order), the label as raw uint8 bytes (x, y, z), and a
JSON string of metadata. Raw bytes make the round trip bit-exact.

Example:
```python
dataset = record_dataset("OUT", "train")        # tf.data of (image, label, metadata)
for image, label, meta in dataset.take(1):
    print(meta["case_id"].numpy(), image.shape)
sample = read_record("OUT", "train", 3)         # one record, numpy, without reading its shard
for entry, payload in read_record_payloads(path, entries, "GZIP"):    # a shard's records in one pass, no TensorFlow
    case = decode_example(payload, "float16")   # numpy views of the payload
```
"""

from __future__ import annotations

import gzip
import hashlib
import json
import struct
import zlib
from pathlib import Path

import numpy as np

from tfmis.errors import ConfigError, DataError, MissingInput

SCHEMA_VERSION = 1
INDEX_FILE = "index.json"
FINGERPRINT_FILE = "fingerprint.json"
COMPRESSIONS = {"NONE": "", "GZIP": ".gz", "ZLIB": ".zlib"}
_HEADER = 12  # uint64 length + uint32 masked crc of the length
_FOOTER = 4  # uint32 masked crc of the data
_CHUNK = 1 << 18  # what a compressed shard is read and inflated by


class UnknownSplit(ConfigError, KeyError):
    """A split name the dataset does not have (data.train_split, data.val_split, --split)."""


def shard_name(split: str, shard: int, num_shards: int, compression: str) -> str:
    return f"{split}-{shard:03d}-of-{num_shards:03d}.tfrecord{COMPRESSIONS[compression]}"


def framed_size(payload_length: int) -> int:
    """Bytes one record takes in an (uncompressed) TFRecord stream."""
    return _HEADER + payload_length + _FOOTER


def encode_example(case_id: str, image: np.ndarray, label: np.ndarray | None, metadata: dict) -> bytes:
    """Serialises one preprocessed case into a `tf.train.Example`: the bytes of
    `tf.train.Example(...).SerializeToString(deterministic=True)` (tested), written out here so that the image and
    label are copied once, into the record, not three times (their bytes, the protocol buffer, its serialisation):
    converting 512 x 512 x 300 CT cases, the converting process peaked at 852 MB instead of 1,217 MB."""
    image = np.ascontiguousarray(image, dtype=image.dtype.newbyteorder("<"))
    has_label = label is not None
    label = np.ascontiguousarray(label, dtype=np.uint8) if has_label else np.zeros(0, np.uint8)
    features = {
        "case_id": _bytes_feature(case_id.encode()),
        "image": _bytes_feature(memoryview(image).cast("B")),
        "image_shape": _ints_feature(image.shape),
        "label": _bytes_feature(memoryview(label).cast("B")),
        "label_shape": _ints_feature(label.shape if has_label else (0, 0, 0)),
        "metadata": _bytes_feature(json.dumps(metadata, sort_keys=True).encode()),
    }
    # the map's entries in the order protobuf's runtime (upb) writes a deterministic map: byte order of the keys, a
    # key before its own prefix ("image_shape" before "image")
    order = sorted(features, key=lambda key: key.encode() + b"\xff")
    entries = [_message(1, _message(1, [key.encode()]) + _message(2, features[key])) for key in order]
    return b"".join(_message(1, [piece for entry in entries for piece in entry]))


# Protocol buffer wire format (https://protobuf.dev/programming-guides/encoding/), as pieces joined once at the end:
# a length-delimited field is its tag (field number << 3 | 2), the length as a varint, then the bytes.


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # an int64 as protocol buffers write it: negative values in ten bytes
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _message(number: int, pieces: list) -> list:
    """Field `number` (length-delimited) holding the concatenation of `pieces` (bytes or byte memoryviews)."""
    return [_varint(number << 3 | 2), _varint(sum(len(p) for p in pieces)), *pieces]


def _bytes_feature(value) -> list:
    """tf.train.Feature(bytes_list=BytesList(value=[value]))."""
    return _message(1, _message(1, [value]))


def _ints_feature(values) -> list:
    """tf.train.Feature(int64_list=Int64List(value=values)): field 3, the values packed."""
    packed = b"".join(_varint(int(v)) for v in values)
    return _message(3, _message(1, [packed]) if packed else [])


def parse_example(serialized, image_dtype: str = "float16", half_as_bits: bool = False):
    """Parses one serialized record into (image, label, metadata) tensors.

    Args:
        serialized: a scalar string tensor (one record).
        image_dtype: the storage dtype written at conversion (`index["preprocessing"]["image_dtype"]`).
        half_as_bits: a float16 image comes as its uint16 bits (`image_as_float32` reads it). For tf.data
            functions: a float16 tensor leaving a function asks oneDNN for a float16 kernel, which CPUs without
            AVX512-FP16 answer with an error line in the log.

    Returns:
        image (x, y, z, C) of `image_dtype` (uint16 bits with `half_as_bits`); label (x, y, z) uint8 (shape
        (0, 0, 0) for unlabelled cases); metadata dict with `case_id` (string) and `metadata` (JSON string).
    """
    import tensorflow as tf

    spec = {
        "case_id": tf.io.FixedLenFeature([], tf.string),
        "image": tf.io.FixedLenFeature([], tf.string),
        "image_shape": tf.io.FixedLenFeature([4], tf.int64),
        "label": tf.io.FixedLenFeature([], tf.string),
        "label_shape": tf.io.FixedLenFeature([3], tf.int64),
        "metadata": tf.io.FixedLenFeature([], tf.string),
    }
    f = tf.io.parse_single_example(serialized, spec)
    # float16 is decoded and reshaped as its uint16 bits, then bitcast: oneDNN has no float16 kernels on CPUs
    # without AVX512-FP16, and any float16 op it is asked about (DecodeRaw, Reshape, slicing) logs an error line
    # once per process. Consumers cast to float32 before they slice (Bitcast and Cast do not ask oneDNN).
    raw = tf.uint16 if image_dtype == "float16" else tf.dtypes.as_dtype(image_dtype)
    image = tf.reshape(tf.io.decode_raw(f["image"], raw, little_endian=True), f["image_shape"])
    if image_dtype == "float16" and not half_as_bits:
        image = tf.bitcast(image, tf.float16)
    label = tf.reshape(tf.io.decode_raw(f["label"], tf.uint8), f["label_shape"])
    return image, label, {"case_id": f["case_id"], "metadata": f["metadata"]}


def image_as_float32(image):
    """A parsed image in float32: stored float32, float16, or float16's uint16 bits (`parse_example`'s
    `half_as_bits`), without a float16 op besides the bitcast."""
    import tensorflow as tf

    if image.dtype == tf.uint16:
        return tf.cast(tf.bitcast(image, tf.float16), tf.float32)
    return tf.cast(image, tf.float32)


def load_index(dataset_dir: str | Path) -> dict:
    """The `index.json` of a converted dataset; a clear error if the folder is not one."""
    path = Path(dataset_dir) / INDEX_FILE
    if not path.is_file():
        raise MissingInput(
            f"{path}: not found; is {dataset_dir} the --target-dir of tfmis-convert (and did the conversion finish)?"
        )
    index = json.loads(path.read_text())
    if index.get("schema_version") != SCHEMA_VERSION:
        raise DataError(
            f"{path}: schema version {index.get('schema_version')} is not supported "
            f"(this tfmis reads version {SCHEMA_VERSION}); convert the dataset again"
        )
    return index


RUN_DATA_FILE = "training_data.json"


def training_data_info(index: dict, dataset_dir: str | Path) -> dict:
    """What a trained model needs to know about its data, copied into the run folder at training start.

    The preprocessing, channel names, class names and split case lists of the converted dataset, in
    the same keys as `index.json`, so that prediction works after the TFRecord folder is gone.
    """
    return {
        "schema_version": index["schema_version"],
        "dataset_dir": str(Path(dataset_dir).resolve()),
        "source": index["source"],
        "preprocessing": index["preprocessing"],
        "splits": {name: {"cases": split["cases"]} for name, split in index["splits"].items()},
    }


def load_training_data_info(run_dir: str | Path | None, dataset_dir: str | Path) -> dict:
    """`RUN_DATA_FILE` of a run folder; for runs older than that file, the dataset's `index.json`."""
    path = Path(run_dir) / RUN_DATA_FILE if run_dir is not None else None
    if path is not None and path.is_file():
        return json.loads(path.read_text())
    return load_index(dataset_dir)


SPLIT_JOIN = "+"  # "fold0+fold1+fold3": the union of those splits, e.g. the training part of a fold


def fold_name(fold: int) -> str:
    """The split name of fold `fold` of a K-fold conversion (`fold0`, `fold1`, ...)."""
    return f"fold{fold}"


def cross_validation_splits(folds: int, fold: int) -> tuple[str, str]:
    """(training split, validation split) of fold `fold` of `folds`: every other fold joined, and fold `fold`.

    Example:
        >>> cross_validation_splits(5, 2)
        ('fold0+fold1+fold3+fold4', 'fold2')
    """
    if not 0 <= fold < folds:
        raise ConfigError(f"fold {fold} is out of range for {folds} folds (0..{folds - 1})")
    return SPLIT_JOIN.join(fold_name(k) for k in range(folds) if k != fold), fold_name(fold)


def split_parts(index: dict, name: str) -> list[str]:
    """The split names in `name` (one name, or several joined by `SPLIT_JOIN`), each checked against `index`.

    Raises:
        KeyError: a part is not a split of this dataset (named, with the available ones).
        ValueError: a part is named twice.
    """
    parts = name.split(SPLIT_JOIN)
    for part in parts:
        if part not in index["splits"]:
            raise UnknownSplit(
                f"split {part!r}{f' (in {name!r})' if part != name else ''} not in this dataset; available: "
                f"{sorted(index['splits'])}"
            )
    repeated = sorted({p for p in parts if parts.count(p) > 1})
    if repeated:
        raise ConfigError(f"split {name!r} names {repeated[0]!r} twice; join each split once")
    return parts


def split_entry(index: dict, name: str) -> dict:
    """`index["splits"][name]`, also for joined names "a+b+c": their `cases`, `num_records` and `shards`
    merged in the order given (so a joined split reads like one split of the combined cases). Also for a run's
    `training_data_info`, whose splits hold only `cases`: then only `cases` is returned."""
    entries = [index["splits"][part] for part in split_parts(index, name)]
    merged = {"cases": [case for entry in entries for case in entry["cases"]]}
    if all("num_records" in entry for entry in entries):
        merged["num_records"] = sum(entry["num_records"] for entry in entries)
    if all("shards" in entry for entry in entries):
        merged["shards"] = [shard for entry in entries for shard in entry["shards"]]
    return merged


def split_cases(index: dict, split: str) -> list[dict]:
    """The records of `split` (a name or joined names) in storage order (entries of `index["cases"]`): the
    parts in the order given, each by shard and position."""
    order = {part: i for i, part in enumerate(split_parts(index, split))}
    cases = [c for c in index["cases"].values() if c["split"] in order]
    return sorted(cases, key=lambda c: (order[c["split"]], c["shard"], c["position"]))


def shard_paths(dataset_dir: str | Path, split: str, index: dict | None = None) -> list[str]:
    """The shard files of `split` (a name or joined names) that hold records, in `split_entry` order."""
    index = index or load_index(dataset_dir)
    return [str(Path(dataset_dir) / s["file"]) for s in split_entry(index, split)["shards"] if s["records"] > 0]


def record_dataset(dataset_dir: str | Path, split: str, num_parallel_reads=None, deterministic: bool = True):
    """A `tf.data.Dataset` of (image, label, metadata) for one split, parsed in parallel.

    Args:
        dataset_dir: the converted dataset folder.
        split: e.g. `train`, `val`, `test`, `fold0`, or joined splits `fold0+fold1`.
        num_parallel_reads: shards read concurrently (default: AUTOTUNE).
        deterministic: keep storage order (set False for throughput when order does not matter).
    """
    import tensorflow as tf

    index = load_index(dataset_dir)
    files = shard_paths(dataset_dir, split, index)
    prep = index["preprocessing"]
    dataset = tf.data.TFRecordDataset(
        files,
        compression_type=_tf_compression(prep["compression"]),
        num_parallel_reads=num_parallel_reads or tf.data.AUTOTUNE,
    )
    options = tf.data.Options()
    options.deterministic = deterministic
    parse = tf.autograph.experimental.do_not_convert(lambda s: parse_example(s, prep["image_dtype"]))  # as written
    return dataset.map(parse, num_parallel_calls=tf.data.AUTOTUNE).with_options(options)


def read_record_bytes(path: str | Path, offset: int, length: int, compression: str) -> bytes:
    """One record's payload, read at its offset: no other record of the shard is parsed.

    Uncompressed shards are read with a seek; compressed ones are decompressed only up to the record.
    """
    with _open_stream(Path(path), compression) as stream:
        _skip(stream, offset)
        return bytes(_read_payload(stream, path, offset, length))


def read_record_payloads(path: str | Path, entries: list[dict], compression: str):
    """Yields `(entry, payload)` for each of `entries` (index.json's case entries of the shard at `path`) in the
    order of their offsets, reading (or decompressing) the shard once from its start.

    `payload` is a bytearray of the record's bytes, read into place (no other copy), its length and, where the
    entry has one, its sha256 checked against the entry (a `DataError` naming the shard when they differ). A
    consumer that drops the payload (and `decode_example`'s views of it) before asking for the next holds one
    record in memory at a time.
    """
    path = Path(path)
    with _open_stream(path, compression) as stream:
        position = 0
        for entry in sorted(entries, key=lambda e: int(e["offset"])):
            offset, length = int(entry["offset"]), int(entry["length"])
            if offset < position:
                raise DataError(f"{path}: index.json places two records at byte {offset}; convert the dataset again")
            _skip(stream, offset - position)
            payload = _read_payload(stream, path, offset, length)
            if len(stream.read(_FOOTER)) != _FOOTER:
                raise DataError(f"{path}: truncated after the record at byte {offset}")
            position = offset + framed_size(length)
            if entry.get("sha256") and hashlib.sha256(payload).hexdigest() != entry["sha256"]:
                raise DataError(
                    f"{path}: the record at byte {offset} ({entry.get('case_id')}) differs from the sha256 "
                    "index.json holds: the shard changed after its conversion; convert the dataset again"
                )
            yield entry, payload
            del payload  # before the next record is read


def _read_payload(stream, path, offset: int, length: int) -> bytearray:
    header = stream.read(_HEADER)
    if len(header) != _HEADER:
        raise DataError(f"{path}: truncated at byte {offset} (record header)")
    (stored_length,) = struct.unpack("<Q", header[:8])
    if stored_length != length:
        raise DataError(
            f"{path}: record at byte {offset} has length {stored_length}, index says {length}; "
            "the shard does not match index.json"
        )
    payload = bytearray(length)
    view, filled = memoryview(payload), 0
    while filled < length:
        if isinstance(stream, gzip.GzipFile):  # its readinto reads a whole copy first: chunks copied in place
            chunk = stream.read1(min(length - filled, _CHUNK))
            got = len(chunk)
            view[filled : filled + got] = chunk
        else:
            got = stream.readinto(view[filled:])
        if not got:
            raise DataError(f"{path}: truncated record at byte {offset}")
        filled += got
    view.release()
    return payload


def decode_example(payload, image_dtype: str = "float16") -> dict:
    """One record's payload (a serialized `tf.train.Example` of `encode_example`'s features) as numpy arrays that
    are views of `payload`: nothing is copied and TensorFlow is not used. The same arrays as `parse_example`
    (tested, records of `encode_example` and of `tf.train.Example` alike).

    Returns:
        dict with `case_id` (str), `image` (x, y, z, C) of `image_dtype`, `label` (x, y, z) uint8 (shape (0, 0, 0)
        for an unlabelled case), `metadata` (dict). A payload that is not such a record raises `ValueError`.
    """
    buffer = memoryview(payload).cast("B")
    features = {}
    for number, wire, span in _fields(buffer, 0, len(buffer)):
        if (number, wire) != (1, 2):  # Example.features
            continue
        for number, wire, entry in _fields(buffer, *span):
            if (number, wire) != (1, 2):  # Features.feature: a map entry
                continue
            key, value = None, None
            for number, wire, part in _fields(buffer, *entry):
                if (number, wire) == (1, 2):
                    key = bytes(buffer[part[0] : part[1]]).decode()
                elif (number, wire) == (2, 2):
                    value = part
            features[key] = value  # a map's later entry wins, as in protocol buffers

    def spans(key: str, kind: int) -> list:
        """The values of feature `key`'s list of `kind` (1 bytes, 3 int64) as (wire, value) pairs."""
        if features.get(key) is None:
            raise ValueError(f"no feature {key!r}")
        out = []
        for number, wire, value in _fields(buffer, *features[key]):
            if (number, wire) == (kind, 2):
                out += [(w, v) for n, w, v in _fields(buffer, *value) if n == 1]
        return out

    def one_bytes(key: str) -> memoryview:
        values = spans(key, 1)
        if len(values) != 1 or values[0][0] != 2:
            raise ValueError(f"feature {key!r} holds {len(values)} byte strings, not one")
        return buffer[values[0][1][0] : values[0][1][1]]

    def ints(key: str, count: int) -> tuple:
        values = []
        for wire, value in spans(key, 3):
            if wire == 0:
                values.append(value)
            elif wire == 2:  # packed
                pos, end = value
                while pos < end:
                    v, pos = _read_varint(buffer, pos)
                    values.append(v)
        values = [v - (1 << 64) if v >= 1 << 63 else v for v in values]
        if len(values) != count:
            raise ValueError(f"feature {key!r} holds {len(values)} integers, not {count}")
        return tuple(values)

    image_shape, label_shape = ints("image_shape", 4), ints("label_shape", 3)
    image_bytes, label_bytes = one_bytes("image"), one_bytes("label")
    dtype = np.dtype(image_dtype).newbyteorder("<")
    if len(image_bytes) != int(np.prod(image_shape)) * dtype.itemsize or len(label_bytes) != int(np.prod(label_shape)):
        raise ValueError(f"image or label bytes do not fill shapes {image_shape} and {label_shape} of {image_dtype}")
    return {
        "case_id": bytes(one_bytes("case_id")).decode(),
        "image": np.frombuffer(image_bytes, dtype).reshape(image_shape),
        "label": np.frombuffer(label_bytes, np.uint8).reshape(label_shape),
        "metadata": json.loads(bytes(one_bytes("metadata"))),
    }


def _read_varint(buffer: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buffer) or shift > 63:
            raise ValueError(f"a varint runs past its end at byte {pos}")
        byte = buffer[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(buffer: memoryview, start: int, end: int):
    """The fields of the message in `buffer[start:end]`: (number, wire type, value), the value a varint's integer or
    a length-delimited field's (start, end); fixed-size fields are skipped."""
    pos = start
    while pos < end:
        key, pos = _read_varint(buffer, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(buffer, pos)
            yield number, wire, value
        elif wire == 2:
            size, pos = _read_varint(buffer, pos)
            if pos + size > end:
                raise ValueError(f"field {number} runs past its message at byte {pos}")
            yield number, wire, (pos, pos + size)
            pos += size
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise ValueError(f"wire type {wire} at byte {pos}")
    if pos != end:
        raise ValueError(f"a field runs past its message at byte {end}")


def read_record(dataset_dir: str | Path, split: str, sample: int) -> dict:
    """Record number `sample` of `split` as numpy arrays (reads only that record).

    Returns:
        dict with `case_id`, `image` (x, y, z, C), `label` (x, y, z) or None, `metadata` (dict).
    """
    index = load_index(dataset_dir)
    cases = split_cases(index, split)
    if not 0 <= sample < len(cases):
        raise IndexError(f"sample {sample} out of range: split {split!r} has {len(cases)} records")
    entry = cases[sample]
    payload = read_record_bytes(
        Path(dataset_dir) / entry["file"], entry["offset"], entry["length"], index["preprocessing"]["compression"]
    )
    image, label, meta = parse_example(payload, index["preprocessing"]["image_dtype"])
    return {
        "case_id": meta["case_id"].numpy().decode(),
        "image": image.numpy(),
        "label": label.numpy() if label.shape[0] > 0 else None,
        "metadata": json.loads(meta["metadata"].numpy()),
    }


def _tf_compression(compression: str) -> str:
    return "" if compression == "NONE" else compression


class _ZlibStream:
    """Minimal forward-only reader over a zlib-compressed file (TF's ZLIB TFRecord option), inflating into the
    caller's buffer."""

    def __init__(self, path: Path):
        self._file = open(path, "rb")
        self._inflate = zlib.decompressobj()
        self._pending = b""  # compressed bytes read, not yet inflated

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        filled = 0
        while filled < len(view) and not self._inflate.eof:
            if not self._pending:
                self._pending = self._file.read(_CHUNK)
                if not self._pending:
                    break
            out = self._inflate.decompress(self._pending, min(len(view) - filled, _CHUNK))
            self._pending = self._inflate.unconsumed_tail
            view[filled : filled + len(out)] = out
            filled += len(out)
        return filled

    def read(self, n: int) -> bytes:
        buffer = bytearray(n)
        return bytes(buffer[: self.readinto(buffer)])

    def skip(self, n: int) -> int:
        """Moves up to `n` bytes forward (returns how many), inflating them into one small buffer."""
        buffer, skipped = bytearray(min(n, _CHUNK)), 0
        while skipped < n:
            got = self.readinto(memoryview(buffer)[: min(n - skipped, len(buffer))])
            if not got:
                break
            skipped += got
        return skipped

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()


def _open_stream(path: Path, compression: str):
    if compression == "NONE":
        return open(path, "rb")
    if compression == "GZIP":
        return gzip.open(path, "rb")
    if compression == "ZLIB":
        return _ZlibStream(path)
    raise ConfigError(f"unknown compression {compression!r}; expected one of {sorted(COMPRESSIONS)}")


def _skip(stream, offset: int) -> None:
    """Moves `offset` bytes forward."""
    if hasattr(stream, "seek"):
        stream.seek(offset, 1)
        return
    while offset > 0:
        got = stream.skip(offset) if hasattr(stream, "skip") else len(stream.read(min(offset, _CHUNK)))
        if got == 0:
            raise DataError("offset beyond the end of the shard")
        offset -= got
