"""Checkpoints: the folder protocol (folder.py), the Checkpointer of a run (checkpointer.py), the
DCP readers and writers that run no code from the files (storage/), and the conversion of
optimizer states between shardings (reshard.py)."""
