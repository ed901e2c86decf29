"""Process groups and the layers and collectives that split a model over GPUs."""
