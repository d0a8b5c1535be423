"""Managed-collision ("zero-collision", zch) embedding tables, for any app: TorchRec's
``ManagedCollisionCollection`` of ``MCHManagedCollisionModule`` s wrapped with the app's tables.

What a zch table is. A hashed table folds every id into its rows, so frequent ids share rows with
rare ones. A zch table of N rows keeps an id-to-row map instead: every ``--zch_eviction_interval``
training steps, TorchRec's module counts the ids seen since the last time and lets the ids its
``--zch_eviction_policy`` ranks highest (lfu: most seen, lru: most recently seen, distance_lfu:
counts divided by the steps since last seen) take the rows of those it ranks lowest; a row that
changes hands is re-initialised (weights and optimizer state). Until an id has a row of its own,
and for every id never seen (evaluation, serving), it is looked up in its rank's share's last row,
which TorchRec keeps for them (a per-rank default embedding that all such ids train together).

Its ids. TorchRec's module takes ids in ``[0, input_hash_size)`` and, sharded row-wise, sends each
id to the rank whose share of that range holds it, so the apps feed it SplitMix64 of the raw value
(of a text's FNV-1a 64) modulo :data:`INPUT_HASH_SIZE`, as ``--categorical_ids hash`` does modulo
the table's size: distinct raw ids then collide with a chance of about n^2/2^64 (none in practice).

Its state (the sorted ids, their rows and the policy's counts or last steps, int64 each) is model
state: TorchRec's sharded module shards it row-wise with the table, as ShardedTensors that DCP
checkpoints with the weights. TorchRec's sharder shards these tables row-wise only
(:data:`SHARDING_TYPES`): each rank remaps the ids of its share of the input range into its rows.
A checkpoint's state resumes on its world size and loads on any other these tables allow: merged
into a world size that divides it (a merged share's ids and rows are those of the ranks merged,
which TorchRec's load checks), down to the single unsharded module that export and serving load;
split across any other (:mod:`apps.core.checkpoint.id_maps`: each rank keeps the saved ids of
its share of the input range, with their rows and optimizer state; where more of them than its
rows, those its eviction policy ranks highest).
"""
