"""The DCP format: the standard item encoding (``format``), the writer (``writer``) and the validating reader
(``reader``)."""
