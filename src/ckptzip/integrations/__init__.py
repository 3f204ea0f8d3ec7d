"""Framework integrations: Lightning (lightning.py) and Hugging Face transformers (hf.py)."""
