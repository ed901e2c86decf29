"""Performance accounting: FLOPs, GPU peaks, memory and step-time models."""
