"""The data path: the corpus and the global sample order (``corpus``), the data formats (``sources``), tokenizers
(``tokenize``) and the memory-mapped token cache (``token_cache``)."""
