"""Decoder-only transformer models and their named presets."""
