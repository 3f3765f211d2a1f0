"""Make sure the training data exists: generate the demo dataset and convert to TFRecords if needed.

Example:
```python
dataset_dir = prepare_dataset(config.data)   # no-op when data.dataset_dir is already converted
```
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tfmis.data.conversion_options import ConversionConfig, ConversionOptions
from tfmis.data.convert import convert, summary_text
from tfmis.data.records import INDEX_FILE
from tfmis.errors import MissingInput


def check_data_source(data) -> None:
    """The data a training needs is there, checked before anything is started or written (the run folder's lock
    included): a converted `data.dataset_dir` (its index.json), or a `data.source_dir` holding dataset.json (the
    demo's is generated).

    Raises:
        MissingInput: no converted dataset and no source to convert (exit 1).
        DatasetNotFound: `data.source_dir` holds no dataset.json (exit 2).
    """
    from tfmis.data.sources.errors import DatasetNotFound

    target = Path(data.dataset_dir)
    if data.source_dir is None:
        if not (target / INDEX_FILE).is_file():
            raise MissingInput(
                f"data.dataset_dir {target} holds no converted dataset ({INDEX_FILE} missing): "
                "convert one with tfmis-convert, or set data.source_dir to an MSD folder "
                "to convert it automatically"
            )
    elif not data.demo and not (Path(data.source_dir) / "dataset.json").is_file():
        raise DatasetNotFound(
            f"data.source_dir {data.source_dir}: no dataset.json there; give the dataset folder (MSD or nnU-Net v2 "
            "raw) that holds dataset.json, or data.source_dir=null with data.dataset_dir a converted dataset"
        )


def prepare_dataset(data, progress: bool = True) -> Path:
    """Returns `data.dataset_dir`, converting `data.source_dir` into it first when given.

    With `data.source_dir` set, the conversion always runs: it resumes an interrupted one, does
    nothing for a finished one, and refuses a target converted with other parameters. A conversion of the
    same target running in another process (a cross-validation's other fold, a second training started at
    once) is waited for, not refused: this process needs its result, it does not compete with it.

    Args:
        data: a `tfmis.config.DataConfig`.
    """
    check_data_source(data)
    target = Path(data.dataset_dir)
    if data.source_dir is None:
        return target
    if data.demo:
        from tfmis.data.demos.brain import make_demo_dataset

        present = (Path(data.source_dir) / "dataset.json").is_file()
        make_demo_dataset(data.source_dir)
        if progress:
            print(f"Demo dataset: {data.source_dir} ({'already there' if present else 'generated'})")
    config = ConversionConfig(
        source_dir=data.source_dir,
        target_dir=str(target),
        progress=progress,
        splits_file=data.split.file if data.split is not None else None,  # the folds of a cross-validation
        **{f.name: getattr(data.conversion, f.name) for f in dataclasses.fields(ConversionOptions)},
    )
    index = convert(config, wait=True)
    if progress:
        print(summary_text(index))
    if index["skipped"]:
        print(f"warning: {len(index['skipped'])} case(s) were skipped during conversion (see {target / INDEX_FILE})")
    return target
