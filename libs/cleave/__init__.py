"""Cleave: train foundation models on the idle compute of many small, unreliable edge devices."""
