"""Tests of checkpointing/ (shared fixtures and helpers: tests/)."""
