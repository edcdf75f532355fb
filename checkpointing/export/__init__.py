"""Exports of a committed step: its weights read one tensor at a time and written as safetensors or torch files
(``weights``), and an export's manifest (``manifest``)."""
