"""One module per patch id; each exposes ``plan(ctx)`` (see ``drama3_patches.patchlib``)."""
