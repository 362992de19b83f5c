"""Fused local attention, tree decoding and the ring baseline."""
