"""Adapters that put StaticMoE into other libraries' models (each imports its library lazily: ``import static_moe``
never needs them). ``static_moe.integrations.transformers``: Hugging Face transformers 5.x MoE models."""
