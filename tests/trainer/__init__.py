"""Tests of trainer/ (shared fixtures and helpers: tests/)."""
