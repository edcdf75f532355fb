"""Bytes in storage: the storage seam (``base``: :class:`Storage`, with compare-and-swap of one document) over
backends behind one interface (``backend``): a local disk (``local``), S3 (``s3``) and any other fsspec protocol
(``generic``); bounded retries (``retry``) and injected faults (``faults``)."""
