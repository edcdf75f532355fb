"""Bytes in storage: the storage seam over fsspec (``base``), compare-and-swap of one document (``cas``), bounded
retries (``retry``) and injected faults (``faults``)."""
