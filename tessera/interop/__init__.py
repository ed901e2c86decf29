"""Import and export of other frameworks' checkpoints."""
