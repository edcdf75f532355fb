"""The ``transformers`` family: its spec (``spec``), context parallelism (``cp``), Mixture-of-Experts models
(``moe``), and Hugging Face directories and weight files validated before anything reads them (``hf_dir``)."""
