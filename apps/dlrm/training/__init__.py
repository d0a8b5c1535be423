"""What the DLRM plugs into the shared training (apps/core/training/): the app (app.py: model,
tables, data, summary figures, and the DLRM's Trainer) and its click metrics (metrics.py)."""
