#!/usr/bin/env python3
"""What durable, verified conversion costs: the sha256 and fsync of every shard against the whole
conversion, and the raw speed of sha256 and crc32 over 1 GB.

Converts the demo dataset (generated under `--data` if missing) with `tfmis.data.convert.convert` once with GZIP
and once uncompressed (`--workers 1`), timing `tfmis.data.shard_writer.file_digest` (the shard read back and
hashed with sha256; the fsyncs of the atomic write are not in it) of each shard, then hashes a 1 GB file of random
bytes (page cache) with sha256 and crc32.

Example:
    python benchmarks/conversion_durability.py --data data/Task90_Demo --output /tmp/durability   # ~2 min on 2 cores
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import time
import zlib
from pathlib import Path

import tfmis.data.convert as conversion
import tfmis.data.shard_writer as shard_writer
from tfmis.data.demos.brain import make_demo_dataset


def _hash_speed(gigabytes: float = 1.0) -> dict:
    size = int(gigabytes * (1 << 30))
    with tempfile.NamedTemporaryFile(delete=False) as f:
        for _ in range(size >> 24):
            f.write(os.urandom(1 << 24))
        path = f.name

    def sha256():
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 22):
                digest.update(block)

    def crc32():
        crc = 0
        with open(path, "rb") as f:
            while block := f.read(1 << 22):
                crc = zlib.crc32(block, crc)

    def read():
        with open(path, "rb") as f:
            while f.read(1 << 22):
                pass

    seconds = {}
    for name, fn in (("read", read), ("sha256", sha256), ("crc32", crc32)):
        best = float("inf")
        for _ in range(2):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        seconds[name] = best / gigabytes
    os.unlink(path)
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="data/Task90_Demo", help="the demo dataset (generated if missing)")
    p.add_argument("--output", default="/tmp/conversion_durability", help="scratch folder for the conversions")
    args = p.parse_args()
    source = make_demo_dataset(args.data)
    spent = [0.0, 0]
    digest = shard_writer.file_digest

    def timed(path):
        t = time.perf_counter()
        result = digest(path)
        spent[0] += time.perf_counter() - t
        spent[1] += result[0]
        return result

    shard_writer.file_digest = timed  # read by write_shard and finished_shards there
    print("| compression | conversion | shards | read back + sha256 | share | per GB of shards |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for compression in ("GZIP", "NONE"):
        target = Path(args.output) / compression
        shutil.rmtree(target, ignore_errors=True)
        spent[:] = [0.0, 0]
        t = time.perf_counter()
        conversion.convert(
            conversion.ConversionConfig(
                str(source), str(target), workers=1, progress=False, compression=compression, shards=4
            )
        )
        total = time.perf_counter() - t
        print(
            f"| {compression} | {total:.1f} s | {spent[1] / 1e6:.1f} MB | {spent[0]:.2f} s | {spent[0] / total:.1%} "
            f"| {spent[0] / max(spent[1], 1) * 1e9:.1f} s |"
        )
    speed = _hash_speed()
    print(", ".join(f"{name} {s:.2f} s/GB" for name, s in speed.items()) + " (1 GB from the page cache)")


if __name__ == "__main__":
    main()
