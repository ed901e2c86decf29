"""Text generation from trained models."""
