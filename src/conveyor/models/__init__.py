"""Trained models: the champion/challenger registry."""
