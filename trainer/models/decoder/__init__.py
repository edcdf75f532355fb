"""The built-in Llama-style decoder family: its spec (``spec``), the model (``model``), its tensor-parallel plan
(``tp``) and its mixture of experts (``moe``)."""
