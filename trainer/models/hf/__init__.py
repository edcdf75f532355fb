"""The ``transformers`` family: its spec (``spec``), context parallelism (``cp``), mixture-of-experts models
(``moe``), pipeline cuts (``llama_layout``) and validated directories and weight files (``hf_dir``)."""
