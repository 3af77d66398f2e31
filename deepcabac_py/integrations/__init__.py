"""Adapters to other frameworks (Flower, zarr/numcodecs, DDP), each behind its own optional extra."""
