import os

# Tests never touch the Hub: tiny models are built from configs, the tokenizer ships with the repo.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
