"""Tests of orchestrator/ (shared fixtures and helpers: tests/)."""
