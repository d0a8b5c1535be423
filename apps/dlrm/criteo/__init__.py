"""The Criteo click logs (1TB or Kaggle): parsing, preprocessing into a binary layout, and the
table sizes of TorchRec's DLRM on them. The training dataset is apps.dlrm.data.criteo."""
