"""Hugging Face parameter names and layouts: Llama (``llama``), Mixtral (``mixtral``) and Qwen MoE
(``qwen_moe``)."""
