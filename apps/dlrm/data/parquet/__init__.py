"""Click logs in Parquet files, local or in an object store, for ``--data parquet``.

One module, one job: :mod:`.files` finds the files and checks their footers before training
starts, :mod:`.order` says which rows each rank reads in each epoch (pure arithmetic on row
counts), :mod:`.read` fetches and decodes row groups into arrays. The data source that puts
them together is :mod:`.loader`.
"""
