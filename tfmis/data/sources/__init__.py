"""Where cases come from, read as they are stored: the case and the dataset every layout gives (`cases`), the
layouts (`msd`, `nnunet`, picked by `layouts.open_dataset`), DICOM series (`dicom_series`), the one reader and
writer of image files (`image_io`), and the errors of all of them (`errors`). Nothing here preprocesses or converts:
`tfmis.data.preprocess` and `tfmis.data.convert` build on it."""
