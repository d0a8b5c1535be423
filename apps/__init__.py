"""The apps of the registry (``apps.dlrm``, ``apps.hstu``) and what they share (``apps.core``)."""

from apps.core.common.library_warnings import filter_known_warnings

# Here, the first module of the project any process imports: FBGEMM logs one of the known-harmless
# warnings while it is being imported, before any command of ours runs a line of its own.
filter_known_warnings()
