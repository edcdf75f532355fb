"""The built-in Llama-style decoder family: its spec (``spec``), the model (``model``) and its tensor-, sequence-
and loss-parallel plan (``tp``). Its Mixture-of-Experts layers are ``trainer.models.moe``, which models a user
brings may use too."""
