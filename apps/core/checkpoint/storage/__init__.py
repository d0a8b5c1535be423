"""How checkpoint shards are written and read: DCP with storage that runs no code from the files.

:mod:`apps.core.checkpoint.checkpointer` decides what is saved, where, and when it counts; this
package moves the bytes. Every rank writes its own shards and ``.metadata`` (a pickle, written by
rank 0) says where each tensor's pieces are; loading reads only the pieces a rank holds under its
current sharding, which is how DCP reshards. The files are DCP's own (each tensor a ``torch.save``
entry at an offset of its rank's file), and checkpoints of DCP's own layout, or of DCP's own
writer, load the same way.

Nothing read here runs code, and every byte read is checked against the CRC-32 of its block,
taken as it was written; a mismatch, an unreadable entry or .metadata that does not add up raise
:class:`~apps.core.checkpoint.storage.errors.DamagedCheckpoint`. One job a module:

    saving.py          save_shards(_async): the collective saves, and the host copy of a background one
    writer.py          the writer: where each entry goes, every file checksummed as it is written
    loading.py         load_shards: the collective load, with the reader that suits the location
    reader.py          the reader: files read in place, entries loaded straight into their tensors
    batched_reader.py  the reader for object stores: many entries a request, fetched or streamed
    sources.py         where a reader's bytes come from, each block checked as it arrives
    entries.py         one entry into the tensor (or value) it loads into
    stored_tensor.py   where a plain tensor's bytes lie in a torch.save entry, without torch.load
    metadata.py        .metadata unpickled as DCP's types only, and checked to add up
    unpickling.py      the unpickler both pickles go through: it sets state on nothing it did not make
    checksums.py       the CRC-32 of each block of a shard file: summed, recorded, checked
    errors.py          CheckpointError, DamagedCheckpoint, SaveFailed: one line each, why and what to do
"""
