"""What every app of the registry shares: processes and errors (:mod:`.common`), shaping and
starting a job (:mod:`.launch`), checkpoints that reshard and verify (:mod:`.checkpoint`), the typed
options that drive the command line and the components (:mod:`.options`), and URLs (:mod:`.urls`).

An app (``apps.dlrm``, ...) builds on these; they never import an app's model or data."""
