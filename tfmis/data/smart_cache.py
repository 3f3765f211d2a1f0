"""Partial cache of decoded volumes, refreshed from the TFRecords in the background (`pipeline.cache: partial`).

MONAI's `SmartCacheDataset` idea, written with tf.data operations only (no Python generator, no thread of our
own): the volumes of one input pipeline are read pass after pass (each pass in a new shard order), and the
stream of volumes is cut into overlapping windows:
```
volumes ─repeat─▶ window(cache_num, shift=replace_num) ─prefetch(1)─▶ per window: shuffle(cache_num) ─▶ ...
          cycle k holds volumes [k·r, k·r + n) of the stream; cycle k + 1 drops the r oldest and adds r new
```
A *cycle* yields every cached volume once, in a new seeded order. The next cycle's window is built by the
`prefetch(1)` while the current one trains: it reads its `replace_num` new volumes from the TFRecords in the
background and keeps the other `cache_num - replace_num` by reference (a window holds tensors, not copies).
So at most `cache_num + replace_num` decoded volumes are held, plus a few in flight (`partial_cache_bound`): the
reader has no read-ahead buffers (files read in turn, `REFILL_PARALLELISM` volumes processed at once), so the
total does not grow with the dataset.

Every volume of the share stays `cache_num / replace_num` cycles (1 / `replace_rate`) in the cache; all the
share has passed through it after `share / replace_num` cycles. With `pipeline.deterministic: true` the stream
is reproducible: the reads keep their order, the shard order of each pass and the order within each cycle are
seeded by the stream seed (and the cycle number).

Why windows and not a Python thread feeding `from_generator`: the window keeps each volume once, by reference,
entirely in tf.data's C++ threads (no GIL per volume, no copy into and out of Python), stays reproducible, and
works unchanged under `distribute_datasets_from_function` (each input pipeline caches part of its own share).

Validation volumes are not cached under `partial`: they are read from the TFRecords at each validation (prefetched
one ahead). glibc's malloc may keep freed volume-sized blocks in its per-thread arenas for reuse, which the
resident set then still counts; `MALLOC_MMAP_THRESHOLD_=65536` (or tcmalloc/jemalloc) returns them at once
(`benchmarks/partial_cache.py` measures both).

Example:
```python
cache_num, replace_num = partial_cache_size(config.pipeline, share=400)   # e.g. (100, 25)
stream = smart_cache(volumes, cache_num, replace_num, seed=0)              # infinite, shuffled per cycle
```
"""

from __future__ import annotations

import math
from pathlib import Path

import tensorflow as tf

from tfmis.data.records import split_entry
from tfmis.errors import ConfigError

# volumes the partial cache's reader parses (and computes foreground indices for) at once: enough to refill
# replace_num volumes per cycle in the background, few enough to keep the in-flight memory a small constant
REFILL_PARALLELISM = 2
# decoded volumes in flight besides the cached ones: in the reader, REFILL_PARALLELISM getting their foreground
# indices, as many done and waiting, one being parsed; in the crop stage, up to 4 (its parallel interleave's
# current and next inputs) that may have left the cache already
IN_FLIGHT_VOLUMES = 2 * REFILL_PARALLELISM + 1 + 4


def partial_cache_bound(cache_num: int, replace_num: int) -> int:
    """The most decoded volumes one input pipeline holds with `pipeline.cache: partial`: the cycle's `cache_num`,
    the `replace_num` read for the next cycle, and `IN_FLIGHT_VOLUMES` being read or cropped.

    Example:
        >>> partial_cache_bound(100, 20)   # 100 cached, 20 read ahead, 9 in flight
        129
    """
    return cache_num + replace_num + IN_FLIGHT_VOLUMES


def partial_cache_size(pipeline, share: int) -> tuple[int, int]:
    """`(cache_num, replace_num)` for an input pipeline whose share of the split is `share` volumes.

    `pipeline.cache_num` when set, else `pipeline.cache_rate` of the share (at least 1), capped at the share;
    `replace_num = ceil(replace_rate · cache_num)`, at least 1 and at most the volumes not cached (0 when the
    whole share fits: then nothing is ever replaced).

    Args:
        pipeline: the `PipelineConfig` (cache_num, cache_rate, replace_rate).
        share: the volumes this input pipeline (worker) reads, see `share_size`.

    Example:
        >>> from tfmis.config import PipelineConfig
        >>> partial_cache_size(PipelineConfig(cache="partial", cache_num=100, replace_rate=0.25), 400)
        (100, 25)
    """
    wanted = pipeline.cache_num if pipeline.cache_num is not None else max(1, math.floor(pipeline.cache_rate * share))
    cache_num = max(1, min(int(wanted), share))
    replace_num = min(max(1, math.ceil(pipeline.replace_rate * cache_num)), share - cache_num)
    return cache_num, replace_num


def share_size(index: dict, split: str, shard: dict) -> int:
    """How many volumes of `split` one input pipeline reads, given its `tfmis.data.pipeline.input_shard`."""
    if shard["cases"] is not None:  # data-level sharding: every N-th case
        return len(shard["cases"])
    records = {s["file"]: s["records"] for s in split_entry(index, split)["shards"]}
    return sum(records[Path(f).name] for f in shard["files"])


def smart_cache(volumes: tf.data.Dataset, cache_num: int, replace_num: int, seed: int) -> tf.data.Dataset:
    """The infinite stream of cached volumes: cycle after cycle, each cycle the `cache_num` volumes held
    then, in a seeded random order; between cycles the `replace_num` oldest are replaced by the next ones.

    Args:
        volumes: one pass over the volumes (any element structure); it is repeated here, so give it a shard
            order that changes per pass (`read_records(..., refill_seed=...)`) for new neighbours in the cache.
        cache_num: volumes held (see `partial_cache_size`).
        replace_num: volumes replaced per cycle; 0 = all of `volumes` fit: read once and kept, like `cache()`.
        seed: seeds the order within each cycle (with the cycle number).

    Returns:
        A dataset with the element structure of `volumes`, infinite.
    """
    if cache_num < 1 or replace_num < 0 or replace_num > cache_num:
        raise ConfigError(
            f"smart_cache needs cache_num >= 1 and 0 <= replace_num <= cache_num, got {cache_num} and {replace_num}"
        )
    if replace_num == 0:
        return volumes.cache().shuffle(cache_num, seed=seed, reshuffle_each_iteration=True).repeat()
    windows = volumes.repeat().window(cache_num, shift=replace_num, drop_remainder=True)
    # the next cycle's window (its replace_num new volumes read from the TFRecords) is built while this one trains
    windows = windows.prefetch(1)

    def cycle(number, window):
        # a new order per cycle: rotate the window by a stateless random offset of (seed, cycle), then apply one
        # seeded shuffle (a dataset made inside this function cannot take a per-call seed once a global seed is set)
        members = tf.data.Dataset.zip(window)
        offset = tf.random.stateless_uniform(
            [], tf.stack([tf.constant(seed, tf.int64), number]), maxval=cache_num, dtype=tf.int64
        )
        return members.skip(offset).concatenate(members.take(offset)).shuffle(cache_num, seed=seed)

    # traced as written, without AutoGraph's rewrite (tfmis.data.pipeline's docstring says why)
    return windows.enumerate().flat_map(tf.autograph.experimental.do_not_convert(cycle))
