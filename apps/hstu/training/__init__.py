"""What the HSTU plugs into the shared training (apps/core/training/): the app (app.py: model,
tables, data, metrics, summary figures, and the HSTU's Trainer)."""
