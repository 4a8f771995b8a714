"""Scoring with the project's model: batch (``conveyor predict``) and over HTTP (``conveyor serve-model``)."""
