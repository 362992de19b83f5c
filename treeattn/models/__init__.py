"""Equinox layers and a Llama-style decoder on treeattn attention."""
