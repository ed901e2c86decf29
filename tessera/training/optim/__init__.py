"""Optimizers beyond AdamW, one module each: Muon (muon.py, with its Newton–Schulz iteration in
newton_schulz.py) and distributed Muon (layer_wise.py). tessera.training.optimizer builds them."""
