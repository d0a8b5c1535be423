"""What every room of the app shares and none owns: the configuration error (:mod:`.errors`), the
rank's process group (:mod:`.distributed`), the SplitMix64 hash (:mod:`.hashing`) and the held-out
splits of file-backed click logs (:mod:`.splits`). It imports nothing else from the app."""
