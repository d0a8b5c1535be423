"""The Criteo click logs (1TB or Kaggle), everything about them in one room: the training data
source (:mod:`.loader`) and the copy of a remote folder it reads (:mod:`.fetch`); the
preprocessing that ``python -m apps.dlrm.preprocess`` runs (:mod:`.pipeline`: :mod:`.config`,
:mod:`.sources`, :mod:`.parse`, :mod:`.vocabulary`, :mod:`.convert`), the binary layout it writes
(:mod:`.layout`, or Parquet files: :mod:`.to_parquet`); and the table sizes (:mod:`.tables`) and
multi-hot lookups (:mod:`.multi_hot`) of TorchRec's DLRM on them."""
