"""The generated datasets, each in the MSD layout with `dataset.json`: `brain` (the demo, Task00_DemoBrain: T1w and
T2w, tissue labels and a lesion on the MNI ICBM152 template; `--size brats` the BraTS-size variant of `brats`),
`ct` (CT-like: integer Hounsfield units, anisotropic voxels, small organs), and `anatomy`, the deformed template
they draw on. Commands: `python -m tfmis.data.demos.brain`, `python -m tfmis.data.demos.ct`."""
